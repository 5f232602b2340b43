"""The supervisor <-> orchestrator control directory: drain requests, the drained mark, faults."""

from __future__ import annotations

import time

from lightspec_backend.control import CONTROL_ENV, RESTARTS_ENV, ControlDir, Drain, restarts_from_env


def test_drain_is_noticed_marked_drained_when_idle_and_expires(tmp_path):
    control = ControlDir(tmp_path)
    control.reset()
    drain = Drain(control)
    assert drain.poll(in_flight=2) is False and not drain.draining  # nothing asked yet
    control.request_drain(grace_s=0.2)
    assert drain.poll(in_flight=2) is False and drain.draining and not control.is_drained()
    time.sleep(0.25)
    assert drain.poll(in_flight=1) is True  # past the deadline: cancel what is left
    assert drain.poll(in_flight=0) is True and control.is_drained()


def test_faults_accumulate_and_reset_forgets_everything(tmp_path):
    control = ControlDir(tmp_path / "c")
    control.reset()
    assert control.faults() == []
    control.report_fault("lightspec_target", "not healthy")
    control.report_fault("lightspec_target", "no answer in 30 s")
    assert [f["message"] for f in control.faults()] == ["not healthy", "no answer in 30 s"]
    control.request_drain(1)
    control.reset()
    assert control.faults() == [] and control.drain_deadline() is None


def test_environment_names_the_directory_and_the_restart_count(tmp_path):
    assert ControlDir.from_env({}) is None
    assert ControlDir.from_env({CONTROL_ENV: str(tmp_path)}).path == tmp_path
    assert restarts_from_env({RESTARTS_ENV: "3"}) == 3
    assert restarts_from_env({RESTARTS_ENV: "x"}) == 0 and restarts_from_env({}) == 0
