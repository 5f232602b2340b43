"""``lightspec_backend.bench.runner``: the plan, the sweep's order, and one orchestrator at a time."""

from __future__ import annotations

from typing import ClassVar

import pytest
from lightspec_backend.bench import runner
from lightspec_backend.bench.configs import parse_configs
from lightspec_backend.bench.runner import BenchPlan, Load, ModelSwitcher, requests_rule, run_bench, sweep_order
from lightspec_backend.bench.workload import Prompt


def test_requests_take_the_prompts_temperature_and_mixed_runs_are_longer():
    prompts = [Prompt("a", "code"), Prompt("b", "shuffled", 1.0)] * 3
    plan = BenchPlan([], [], prompts, max_tokens=8, requests=None, temperature=0.3)
    assert [r.temperature for r in plan.requests_for(4)] == [0.3, 1.0, 0.3, 1.0]
    assert [r.prompt.text for r in plan.requests_for(3, offset=5)] == ["b", "a", "b"]
    # a mixed run is long enough that its slow half's tail does not decide the throughput
    plan.requests_rule = requests_rule(False, "mixed")
    assert plan.num_requests(Load(concurrency=16)) == 128
    assert requests_rule(False, "code") == (16, 2) and requests_rule(True, "mixed") == (16, 4)
    # beside vLLM, runs measure the steady state: 8 requests a client
    assert requests_rule(False, "code", peer=True) == (16, 8) and requests_rule(True, "code", peer=True) == (16, 4)
    assert plan.num_requests(Load(rate=4.0)) == 32  # 8 s of arrivals
    assert BenchPlan([], [], prompts, 8, requests=5).num_requests(Load(concurrency=64)) == 5


def test_sweep_runs_each_load_back_to_back_in_serpentine_order():
    configs, loads = ["none", "s1", "s4", "dyn"], [1, 4, 16]
    r0 = sweep_order(configs, loads, 0)
    r1 = sweep_order(configs, loads, 1)
    for seq in (r0, r1):  # every run once per round, one load at a time
        assert sorted(seq) == sorted((c, lv) for c in configs for lv in loads)
        assert [lv for _, lv in seq] == [1] * 4 + [4] * 4 + [16] * 4
    assert [c for c, _ in r0] == configs + configs[::-1] + configs
    assert [c for c, _ in r1] == configs[::-1] + configs + configs[::-1]  # the next round starts the other way
    # consecutive loads share their boundary configuration: no model switch there
    assert all(r0[4 * i + 3][0] == r0[4 * i + 4][0] for i in range(2))
    assert sweep_order(configs, loads, 1, "config") == [(c, lv) for c in configs for lv in loads]
    with pytest.raises(ValueError, match="order='random'"):
        sweep_order(configs, loads, 0, "random")


class FakeTriton:
    """The model-control calls ModelSwitcher makes, on a dict of model states."""

    def __init__(self, states: dict[str, str], roles: dict[str, str]):
        self.states, self.roles, self.calls = states, roles, []

    def get_model_repository_index(self, as_json=False):
        return {"models": [{"name": n, "state": s} for n, s in self.states.items()]}

    def get_model_config(self, name, as_json=False):
        return {"config": {"backend": "lightspec", "parameters": {"role": {"string_value": self.roles[name]}}}}

    def is_model_ready(self, name):
        return self.states.get(name) == "READY"

    def load_model(self, name):
        self.calls.append(("load", name))
        self.states[name] = "READY"

    def unload_model(self, name):
        self.calls.append(("unload", name))
        self.states[name] = "UNAVAILABLE"

    def close(self):
        self.calls.append(("close",))


def _switcher(states: dict[str, str], managed: list[str]) -> ModelSwitcher:
    roles = {n: "target" if n == "lightspec_target" else "orchestrator" for n in [*states, *managed]}
    sw = ModelSwitcher.__new__(ModelSwitcher)  # no server: the fake answers the model-control calls
    sw.client, sw.managed, sw.active = FakeTriton(states, roles), set(managed), None
    return sw


def test_switcher_keeps_exactly_one_orchestrator_of_the_sweep_loaded():
    sw = _switcher({"lightspec_target": "READY", "lightspec_a": "READY"}, ["lightspec_a", "lightspec_b"])
    sw.activate("lightspec_b")
    assert sw.client.calls == [("unload", "lightspec_a"), ("load", "lightspec_b")]  # the stage stays loaded
    assert sw.is_active("lightspec_b") and not sw.is_active("lightspec_a")
    assert sw.loaded_orchestrators() == ["lightspec_b"]
    sw.close()
    assert sw.client.calls[-2:] == [("unload", "lightspec_b"), ("close",)]


def test_switcher_refuses_to_run_beside_an_orchestrator_outside_the_sweep():
    sw = _switcher({"lightspec": "READY"}, ["lightspec_a"])
    with pytest.raises(SystemExit, match="'lightspec' is loaded and is not part of this sweep"):
        sw.activate("lightspec_a")
    assert sw.client.calls == []


class CountingSwitcher:
    activated: ClassVar[list[str]] = []

    def __init__(self, url, managed):
        self.active = None

    def is_active(self, model):
        return self.active == model

    def activate(self, model):
        CountingSwitcher.activated.append(model)
        self.active = model

    def close(self):
        pass


def test_bench_switches_models_only_when_needed_and_returns_runs_config_by_config(monkeypatch):
    tps = iter([10.0, 20.0, 30.0, 40.0, 12.0, 22.0, 32.0, 42.0, 11.0, 21.0, 31.0, 41.0])
    ran = []

    def fake_run_one(url, metrics_url, cfg, load, plan, log=print):
        ran.append((cfg.config, load.concurrency))
        return {"model": cfg.model_name, "concurrency": load.concurrency, "rate": None, "throughput_tok_s": next(tps)}

    CountingSwitcher.activated = []
    monkeypatch.setattr(runner, "ModelSwitcher", CountingSwitcher)
    monkeypatch.setattr(runner, "run_one", fake_run_one)
    configs = parse_configs(["none", "dynamic"], ["mtp"])
    plan = BenchPlan(configs, [Load(concurrency=1), Load(concurrency=2)], [], 8, None, repeats=3)
    runs = run_bench("url", None, plan, log=lambda msg: None)
    assert ran[:4] == [("none", 1), ("dynamic", 1), ("dynamic", 2), ("none", 2)]  # serpentine
    assert CountingSwitcher.activated[:3] == ["lightspec_none", "lightspec_mtp_dynamic", "lightspec_none"]
    assert [(r["model"], r["concurrency"]) for r in runs] == [("lightspec_none", 1), ("lightspec_none", 2),
                                                              ("lightspec_mtp_dynamic", 1), ("lightspec_mtp_dynamic", 2)]  # fmt: skip
    # each keeps its median round: none at c=1 made 10, then (second in round 2) 22, then 11
    assert runs[0]["throughput_tok_s"] == 11.0 and runs[0]["throughput_repeats"] == [10.0, 22.0, 11.0]
    assert [r["repeat"] for r in runs[0]["round_runs"]] == [0, 1, 2]


def test_the_baseline_is_taken_once_the_warm_ups_requests_are_counted(monkeypatch):
    """The backend publishes its counters at most every 0.25 s: a baseline scraped as the warm-up
    ends can miss the warm-up's requests, and the run's figures would then count them."""
    from lightspec_backend.bench import scrape as scrape_mod
    from lightspec_backend.bench.scrape import finished_requests, parse_metrics

    published = {"n": 0}
    events = []

    def fake_scrape(url):
        events.append(("scrape", published["n"]))
        text = f'vllm:request_success_total{{model_name="m",finished_reason="length"}} {published["n"]}\n'
        if events.count(("scrape", 0)) == 3:  # the warm-up's two requests show up on the third look
            published["n"] = 2
        return parse_metrics(text)

    def fake_warm_up(url, model, plan, stream=None):
        events.append(("warm-up", plan.warmup))

    def fake_drive(url, model, load, plan, stream=None):
        published["n"] += 3  # the run's requests, published by the time the run ends
        return [object()] * 3, 1.0

    for module in (runner, scrape_mod):
        monkeypatch.setattr(module, "scrape", fake_scrape)
    monkeypatch.setattr(runner, "warm_up", fake_warm_up)
    monkeypatch.setattr(runner, "_drive", fake_drive)
    monkeypatch.setattr(runner.time, "sleep", lambda s: None)
    plan = BenchPlan([], [], [Prompt("a", "code")], max_tokens=8, requests=3, warmup=2)
    records, _, before, after, _ = runner._measure("u", "metrics", "m", Load(concurrency=1), plan)
    assert events[0] == ("scrape", 0) and events[1] == ("warm-up", 2)
    assert finished_requests(before, "m") == 2  # not 0: the warm-up's requests are in the baseline
    assert finished_requests(after, "m") - finished_requests(before, "m") == len(records) == 3


class ConfigTriton:
    """A gRPC client that serves one orchestrator's model configuration (None: not a LightSpec
    orchestrator; the server answers that it knows no such model)."""

    def __init__(self, parameters: dict[str, str] | None):
        self.parameters = parameters

    def get_model_config(self, name, as_json=False, client_timeout=None):
        from tritonclient.utils import InferenceServerException

        if self.parameters is None:
            raise InferenceServerException(f"Request for unknown model: '{name}' is not found")
        params = {k: {"string_value": v} for k, v in self.parameters.items()}
        return {"config": {"name": name, "backend": "lightspec", "parameters": params}}

    def close(self):
        pass


def _run_with_steps(monkeypatch, parameters: dict[str, str] | None, steps: int, duration: float) -> dict:
    """run_one on a fake server: ``steps`` engine steps (the backend's metric) in ``duration`` s."""
    import tritonclient.grpc
    from lightspec_backend import params
    from lightspec_backend.bench.client import Record
    from lightspec_backend.bench.scrape import parse_metrics

    cfg = parse_configs(["dynamic"], ["mtp"])[0]

    def scraped(n: int):
        return parse_metrics(f'lightspec:engine_steps_total{{model_name="{cfg.model_name}",engine="0"}} {n}\n')

    records = [Record("code", 0.0, 0.5, duration - 1, duration, tokens=128, responses=100)]
    monkeypatch.setattr(runner, "_measure", lambda *args: (records, duration, scraped(0), scraped(steps), None))
    monkeypatch.setattr(params, "available_cpus", lambda: 4)  # the auto rule's CPUs (the server's)
    monkeypatch.setattr(tritonclient.grpc, "InferenceServerClient", lambda url: ConfigTriton(parameters))
    plan = BenchPlan([cfg], [Load(concurrency=1)], [], 8, None)
    return runner.run_one("u", "metrics", cfg, Load(concurrency=1), plan, log=lambda line: None)


@pytest.mark.parametrize(("parameters", "engines"), [
    ({"speculation": "mtp", "policy": "dynamic"}, 2),  # auto: two engines for speculation on a CPU
    ({"speculation": "none", "policy": "dynamic"}, 1),  # auto: one engine without speculation
    ({"speculation": "mtp", "data_parallel_size": "3"}, 3),
])  # fmt: skip
def test_step_ms_is_the_mean_step_of_one_engine(monkeypatch, parameters, engines):
    """The backend sums ``engine_steps_total`` over its engine processes, which step side by side:
    720 steps in 23 s from two engines is a 63.9 ms step each, not 31.9 ms."""
    run = _run_with_steps(monkeypatch, parameters, steps=720, duration=23.0)
    assert run["step_ms"] == pytest.approx(1000 * 23.0 / (720 / engines))
    assert run["engine_steps"] == 720 and run["engine_processes"] == engines


def test_step_ms_is_the_duration_over_all_steps_where_the_engines_are_unknown(monkeypatch):
    run = _run_with_steps(monkeypatch, None, steps=720, duration=23.0)
    assert run["engine_processes"] is None and run["step_ms"] == pytest.approx(1000 * 23.0 / 720)
