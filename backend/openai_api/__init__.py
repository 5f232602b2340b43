"""An OpenAI-compatible HTTP API in front of a Triton server that serves LightSpec.

A thin asyncio process: FastAPI for the HTTP side, tritonclient's asyncio gRPC client for Triton
(one bidirectional stream per request), so it runs inside ``lightspec serve`` or on its own beside
any Triton (``lightspec openai --triton-url HOST:PORT``).

>>> from lightspec_backend.openai_api import create_app
>>> app = create_app("127.0.0.1:8001")      # uvicorn.run(app, port=8080)
"""


def create_app(*args, **kwargs):
    """:func:`.app.create_app`, imported on first use: ``lightspec serve --help`` and a bad
    parameter's error should not wait for FastAPI to import."""
    from .app import create_app as create

    return create(*args, **kwargs)


__all__ = ["create_app"]
