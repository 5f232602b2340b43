"""Stage models (roles ``target``, ``draft``, ``mtp``): tensors in, runner, tensors out.

A stage model is a plain (not decoupled) Triton model whose input and output tensors are the fields
of the stage dataclasses in :mod:`lightspec_core.stages.contract`. Requests are executed one by one:
each is one packed engine step already, and the runner's KV pool is shared state. A request with a
``profile_spec`` asks for the stage's cost profile instead (``ProfileCall``): the stage takes it
while it loads (:meth:`StageModel.take_profile`), so the engine's first step does not wait for it.
"""

from __future__ import annotations

import json
import traceback
from dataclasses import MISSING, asdict, dataclass, fields

import numpy as np

from lightspec_core.spec.calibrate import ProfileSpec
from lightspec_core.spec.cost import VerifyCost
from lightspec_core.stages.contract import ModelCall, ModelResult, MTPCall, MTPResult, from_tensors, to_tensors
from lightspec_core.stages.executor import LocalExecutor

from .params import Role


@dataclass(frozen=True)
class StageThreads:
    """Torch intra-op threads of a stage model's process, per call: ``small`` for calls of fewer than
    ``large_call_tokens`` tokens, ``large`` for the others."""

    small: int
    large: int
    large_call_tokens: int = 64

    def for_call(self, num_tokens: int) -> int:
        return self.large if num_tokens >= self.large_call_tokens else self.small


def stage_threads(configured: int, cpus: int) -> StageThreads:
    """``num_threads`` when set, for every call. Otherwise a small call (a few requests' tokens) gets
    one thread per CPU but one, leaving a core to the orchestrator's process (engine loop, local MTP
    heads, responses), and a large call one per CPU.

    A small call has little to split, and a second OpenMP worker, which spins for milliseconds after
    each parallel region, holds the core the orchestrator needs next: one thread makes a lone
    request's steps faster. A verification call of 64 requests x 5 tokens is compute, and two
    threads make it faster (docs/benchmarks.md)."""
    if configured > 0:
        return StageThreads(configured, configured)
    return StageThreads(max(1, cpus - 1), cpus)


CALL_TYPES = {Role.TARGET: ModelCall, Role.DRAFT: ModelCall, Role.MTP: MTPCall}
RESULT_TYPES = {Role.TARGET: ModelResult, Role.DRAFT: ModelResult, Role.MTP: MTPResult}


def call_tokens(call) -> int:
    """The work of a call: packed tokens of a model step, drafts of an MTP call."""
    return int(call.input_ids.size) if isinstance(call, ModelCall) else int(np.asarray(call.num_tokens).sum())


class StageModel:
    def __init__(self, role: Role, runner, pb_utils, threads: StageThreads | None = None, set_threads=None):
        """``threads``/``set_threads`` (e.g. ``torch.set_num_threads``): pick the intra-op thread count
        per call by its size (see :func:`stage_threads`); without them the
        process keeps whatever it has."""
        self.call_cls = CALL_TYPES[role]
        self.role = role
        self.runner = runner
        self._local = LocalExecutor({role.value: runner})  # times this stage for its profile
        self.pb = pb_utils
        self.threads = threads
        self.set_threads = set_threads
        self._current_threads = None

    def execute(self, requests: list) -> list:
        return [self._one(r) for r in requests]

    def take_profile(self, spec: ProfileSpec) -> str:
        """Time this stage for ``spec`` (kept: a profile request for the same spec answers from it);
        returns the profile as JSON."""
        self._use_threads(1 << 30)  # the profile's largest calls decide; serving picks per call again
        cost = self._local.profile(self.role.value, spec)
        return json.dumps(cost.to_dict() if isinstance(cost, VerifyCost) else asdict(cost))

    def _use_threads(self, num_tokens: int) -> None:
        if self.threads is not None and self.set_threads is not None:
            n = self.threads.for_call(num_tokens)
            if n != self._current_threads:
                self.set_threads(n)
                self._current_threads = n

    def _read_call(self, request):
        tensors = {}
        for f in fields(self.call_cls):
            t = self.pb.get_input_tensor_by_name(request, f.name)
            if t is None:
                if f.default_factory is not MISSING:  # optional input: its default
                    tensors[f.name] = f.default_factory()
                    continue
                raise ValueError(f"{f.name}: missing input tensor")
            tensors[f.name] = t.as_numpy()
        return from_tensors(self.call_cls, tensors)

    def _profile_response(self, spec_tensor):
        raw = spec_tensor.as_numpy().reshape(-1)[0]
        try:
            spec = ProfileSpec.from_json(raw.decode() if isinstance(raw, bytes) else str(raw))
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"profile_spec: not a profile specification ({e})") from None
        profile = np.array([self.take_profile(spec).encode()], dtype=object)
        return self.pb.InferenceResponse(output_tensors=[self.pb.Tensor("profile", profile)])

    def _one(self, request):
        pb = self.pb
        try:
            spec = pb.get_input_tensor_by_name(request, "profile_spec")
            if spec is not None:
                return self._profile_response(spec)
            call = self._read_call(request)
            self._use_threads(call_tokens(call))
            result = self.runner.execute(call)
        except ValueError as e:
            return pb.InferenceResponse(error=pb.TritonError(str(e), pb.TritonError.INVALID_ARG))
        except Exception as e:  # noqa: BLE001 - a runner failure answers this call; the engine fails its requests
            pb.Logger.log_error(f"[lightspec] stage failed: {traceback.format_exc()}")
            return pb.InferenceResponse(error=pb.TritonError(f"{type(e).__name__}: {e}", pb.TritonError.INTERNAL))
        return pb.InferenceResponse(
            output_tensors=[pb.Tensor(n, np.ascontiguousarray(a)) for n, a in to_tensors(result).items()]
        )
