"""A stand-in for ``triton_python_backend_utils`` so the backend's Triton-facing classes
(:class:`~lightspec_backend.orchestrator.Orchestrator`, :class:`~lightspec_backend.bls.BLSExecutor`,
:class:`~lightspec_backend.stage.StageModel`, :class:`~lightspec_backend.metrics.MetricsReporter`)
run in unit tests without a server. Only the surface those classes use is modelled.

>>> pb = FakePbUtils()
>>> pb.models["lightspec_target"] = StageModel(Role.TARGET, runner, pb)   # BLS calls reach it
>>> request = FakeRequest({"text_input": np.array([b"def f():"], dtype=object)})
>>> orchestrator.submit(request); request.sender.wait_final()
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np


class FakeTensor:
    def __init__(self, name: str, array):
        self._name = name
        self._array = np.asarray(array)

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class FakeTritonError(Exception):
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class FakeResponse:
    def __init__(self, output_tensors=None, error: FakeTritonError | None = None):
        self._outputs = list(output_tensors or [])
        self._error = error

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> FakeTritonError | None:
        return self._error

    def output_tensors(self) -> list[FakeTensor]:
        return self._outputs

    def as_dict(self) -> dict[str, np.ndarray]:
        return {t.name(): t.as_numpy() for t in self._outputs}


class FakeSender:
    """Records what the backend sends; ``cancel()`` makes ``is_cancelled()`` true, as a client's
    ``stop_stream(cancel_requests=True)`` does."""

    def __init__(self):
        self.sent: list[tuple[FakeResponse, int]] = []
        self._cancelled = False
        self._final = threading.Event()
        self.sends_after_final = 0
        self.is_cancelled_after_final = 0
        self.threads: set[str] = set()  # the names of the threads that sent

    def send(self, response=None, flags: int = 0) -> None:
        if self._final.is_set():
            self.sends_after_final += 1
        self.threads.add(threading.current_thread().name)
        self.sent.append((response, flags))
        if flags & 1:
            self._final.set()

    def is_cancelled(self) -> bool:
        if self._final.is_set():  # crashes a real Triton 2.51 server; the backend must never do it
            self.is_cancelled_after_final += 1
        return self._cancelled

    def cancel(self) -> None:
        self._cancelled = True

    def wait_final(self, timeout: float = 30.0) -> bool:
        return self._final.wait(timeout)

    @property
    def final(self) -> FakeResponse | None:
        return self.sent[-1][0] if self._final.is_set() else None

    def data(self) -> list[dict[str, np.ndarray]]:
        return [r.as_dict() for r, _ in self.sent if r is not None and not r.has_error()]

    def text(self) -> str:
        return "".join(d["text_output"][0].decode() for d in self.data())


def check_bls_parameters(parameters) -> None:
    """What the python backend stub checks of ``InferenceRequest(parameters=...)`` (it raises the same)."""
    if parameters is None:
        return
    if not isinstance(parameters, dict):
        raise TypeError(f"Expect dict, got {type(parameters)}")
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TypeError(f"Expect parameters keys to have type str, found type {type(key)}")
        if not isinstance(value, (bool, int, str)):
            raise TypeError(f"Expect parameters values to have type bool/int/str, found type {type(value)}")


class FakeRequest:
    def __init__(
        self, inputs: dict[str, np.ndarray], request_id: str = "", pb=None, requested_outputs: list[str] | None = None
    ):
        self.inputs = {k: FakeTensor(k, v) for k, v in inputs.items()}
        self.sender = FakeSender()
        self._id = request_id
        self._pb = pb
        self.model_name = ""
        self._requested = list(requested_outputs or [])

    def requested_output_names(self) -> list[str]:
        return list(self._requested)

    def get_response_sender(self) -> FakeSender:
        return self.sender

    def is_cancelled(self) -> bool:
        return self.sender.is_cancelled()

    def request_id(self) -> str:
        return self._id

    def exec(self, decoupled: bool = False) -> FakeResponse:
        """BLS: run the registered stage model on this request, like Triton would."""
        model = self._pb.models.get(self.model_name)
        if model is None:
            return FakeResponse(error=FakeTritonError(f"Request for unknown model: '{self.model_name}'"))
        (response,) = model.execute([self])
        return response


class FakeMetric:
    def __init__(self, family: FakeMetricFamily, labels: dict, buckets=None):
        self.family, self.labels, self.buckets = family, labels, buckets
        self.value = 0.0
        self.observations: list[float] = []

    def set(self, v: float) -> None:
        assert self.family.kind == FakeMetricFamily.GAUGE
        self.value = v

    def increment(self, v: float) -> None:
        assert v >= 0 or self.family.kind == FakeMetricFamily.GAUGE
        self.value += v

    def observe(self, v: float) -> None:
        assert self.family.kind == FakeMetricFamily.HISTOGRAM and self.buckets is not None
        self.observations.append(v)


class FakeMetricFamily:
    COUNTER, GAUGE, HISTOGRAM = 0, 1, 2

    def __init__(self, registry: dict, name: str, description: str, kind: int):
        assert name not in registry, f"metric family {name} created twice"
        self.name, self.description, self.kind = name, description, kind
        self.metrics: list[FakeMetric] = []
        registry[name] = self

    def Metric(self, labels: dict | None = None, buckets=None) -> FakeMetric:  # the name Triton's has
        m = FakeMetric(self, dict(labels or {}), buckets)
        self.metrics.append(m)
        return m


class FakeLogger:
    def __init__(self):
        self.lines: list[tuple[str, str]] = []

    def log_info(self, msg: str) -> None:
        self.lines.append(("info", msg))

    def log_warn(self, msg: str) -> None:
        self.lines.append(("warn", msg))

    def log_error(self, msg: str) -> None:
        self.lines.append(("error", msg))


class FakePbUtils(SimpleNamespace):
    """``pb = FakePbUtils()``; register stage models in ``pb.models`` (name -> object with
    ``execute(requests) -> responses``) for BLS; read exported metrics in ``pb.families``."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    def __init__(self):
        super().__init__()
        self.models: dict[str, object] = {}
        self.families: dict[str, FakeMetricFamily] = {}
        self.Tensor = FakeTensor
        self.TritonError = FakeTritonError
        self.InferenceResponse = FakeResponse
        self.Logger = FakeLogger()
        self.TritonModelException = RuntimeError
        families = self.families

        class MetricFamily(FakeMetricFamily):
            def __init__(self, name: str, description: str, kind: int):
                super().__init__(families, name, description, kind)

        self.MetricFamily = MetricFamily
        pb = self

        def inference_request(model_name: str, inputs: list, requested_output_names: list, **kwargs):
            check_bls_parameters(kwargs.get("parameters"))
            r = FakeRequest({t.name(): t.as_numpy() for t in inputs}, pb=pb, requested_outputs=requested_output_names)
            r.model_name = model_name
            return r

        self.InferenceRequest = inference_request

    @staticmethod
    def get_input_tensor_by_name(request: FakeRequest, name: str) -> FakeTensor | None:
        return request.inputs.get(name)

    @staticmethod
    def get_output_tensor_by_name(response: FakeResponse, name: str) -> FakeTensor | None:
        return next((t for t in response.output_tensors() if t.name() == name), None)

    def metric_value(self, name: str, **labels) -> float:
        """Sum of a family's metrics whose labels include ``labels`` (value, or count of observations)."""
        fam = self.families[name]
        ms = [m for m in fam.metrics if all(m.labels.get(k) == v for k, v in labels.items())]
        if fam.kind == FakeMetricFamily.HISTOGRAM:
            return float(sum(len(m.observations) for m in ms))
        return float(sum(m.value for m in ms))
