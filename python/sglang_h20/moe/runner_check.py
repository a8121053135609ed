"""Which MoE runner SGLang resolved for the loaded model, and one line when a feature's MoE hooks cannot see it.

Why: `--moe-runner-backend auto` is resolved per quant method while the model loads (block-FP8: DeepGEMM under a
DeepEP / Mooncake / NIXL dispatch, else the triton runner), and the swapAB and SBO hooks wrap particular runners
(the triton runner's `fused_experts`; swapAB also DeepEP's masked DeepGEMM). On any other runner the switch is on
and every MoE layer runs upstream's kernels: after the model has loaded, each feature says so once, rather than
nothing at all.
"""
from __future__ import annotations

from typing import Callable

from sglang_h20.features import Hook

LOAD_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
NO_RUNNER = "none"  # a MoE layer whose quant method built no MoeRunner (SGLang's flashinfer / cutlass paths, ...)


def resolved_runners(model) -> set[str]:
    """The runner backends (MoeRunnerBackend values) that the model's MoE layers resolved to."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    out = set()
    for module in model.modules():
        if isinstance(module, FusedMoE):
            runner = getattr(getattr(module, "quant_method", None), "runner", None)
            out.add(runner.runner_backend.value if runner is not None else NO_RUNNER)
    return out


def a2a_backend() -> str:
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend

    return get_moe_a2a_backend().value


def unseen(runners: set[str], a2a: str, served: Callable[[str, str], bool]) -> list[str]:
    """The runners among `runners` whose calls the feature's hooks never see (sorted)."""
    return sorted(r for r in runners if not served(r, a2a))


def after_load(note: Callable[[str], None], served: Callable[[str, str], bool], covers: str) -> Hook:
    """An AFTER hook on ModelRunner.load_model: `note` (a feature's OnceLog) gets one line naming the MoE runners
    that `served(runner, a2a)` rejects, and `covers` (what the feature's hooks do wrap)."""

    def check(result, model_runner, *args, **kwargs) -> None:
        model = getattr(model_runner, "model", None)
        if model is None:
            return None
        a2a = a2a_backend()
        missed = unseen(resolved_runners(model), a2a, served)
        if missed:
            names = ", ".join(repr(r) for r in missed)
            note(f"every MoE layer on runner {names} with a2a {a2a!r}: our MoE hooks wrap {covers}")
        return None

    return Hook(LOAD_TARGET, check, "after")
