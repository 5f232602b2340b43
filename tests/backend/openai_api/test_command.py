"""``lightspec serve``'s OpenAI API options: where the API it starts beside tritonserver listens."""

from __future__ import annotations

import pytest
from lightspec_backend import cli
from lightspec_backend.openai_api.command import start_for_serve


def _bound_address(argv: list[str], tmp_path) -> str:
    args = cli.build_parser().parse_args(["serve", "--openai-port", "0", *argv])
    api = start_for_serve(args, "127.0.0.1:1", tmp_path)
    try:
        return api.server.servers[0].sockets[0].getsockname()[0]
    finally:
        api.stop()


def test_serve_starts_the_openai_api_on_loopback_unless_told_otherwise(tmp_path):
    assert _bound_address([], tmp_path) == "127.0.0.1"


def test_serve_openai_host_sets_the_address_so_a_container_can_publish_the_api(tmp_path):
    """Triton's ports listen on every interface; ``--openai-host 0.0.0.0`` puts the API beside them."""
    assert _bound_address(["--openai-host", "0.0.0.0"], tmp_path) == "0.0.0.0"


@pytest.mark.parametrize("argv", [["--no-openai"], ["--openai-port", "-1"]])
def test_serve_without_the_openai_api_starts_none(argv, tmp_path):
    args = cli.build_parser().parse_args(["serve", *argv])
    assert start_for_serve(args, "127.0.0.1:1", tmp_path) is None
