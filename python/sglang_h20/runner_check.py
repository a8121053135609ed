"""What the loaded model runs on, and one line when a feature is on but none of its hooks can see those calls.

Why: SGLang resolves some kernels per layer while the model loads, and our hooks wrap particular ones. The MoE
runner (`--moe-runner-backend auto`, block-FP8: DeepGEMM under a DeepEP / Mooncake / NIXL dispatch, else triton)
must be the triton runner for swapAB's and SBO's `fused_experts` hooks, or DeepGEMM's masked GEMM under DeepEP for
swapAB's other one; the block-FP8 linears (`--fp8-gemm-backend`) must be the triton or DeepGEMM function for our
dense GEMM. On anything else the switch is on and those layers run upstream: after the model has loaded, the
feature says so once, rather than nothing at all.
"""
from __future__ import annotations

import logging
from typing import Callable

from sglang_h20.features import Hook
from sglang_h20.logonce import OnceLog

LOAD_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
NO_RUNNER = "no MoeRunner"  # a MoE layer whose quant method built none (SGLang's flashinfer / cutlass paths, ...)
_failed = OnceLog(logging.getLogger("sglang_h20.runner_check"), "runner check: ")


def moe_runners(model) -> set[str]:
    """The runner backends (MoeRunnerBackend values) that the model's MoE layers resolved to."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    out = set()
    for module in model.modules():
        if isinstance(module, FusedMoE):
            runner = getattr(getattr(module, "quant_method", None), "runner", None)
            out.add(runner.runner_backend.value if runner is not None else NO_RUNNER)
    return out


def block_fp8_linears(model) -> set[str]:
    """The names of the block-FP8 linear functions the model's FP8 linears picked at load (`--fp8-gemm-backend`)."""
    out = set()
    for module in model.modules():
        fn = getattr(getattr(module, "quant_method", None), "w8a8_block_fp8_linear", None)
        if callable(fn):
            out.add(getattr(fn, "__name__", type(fn).__name__))
    return out


def a2a_backend() -> str:
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend

    return get_moe_a2a_backend().value


def after_load(note: Callable[[str], None], unseen: Callable[[object], list[str]],
               message: Callable[[list[str]], str]) -> Hook:
    """An AFTER hook on ModelRunner.load_model: `note` (a feature's OnceLog) gets `message(names)` when
    `unseen(model)` names anything that the feature's hooks never see."""

    def check(result, model_runner, *args, **kwargs) -> None:
        model = getattr(model_runner, "model", None)
        try:  # a diagnostic: it must never stop a server from starting
            names = unseen(model) if model is not None else []
        except Exception as e:
            _failed(f"could not read what the loaded model runs on ({type(e).__name__}: {e}); no line about it")
            return None
        if names:
            note(message(names))
        return None

    return Hook(LOAD_TARGET, check, "after")


def moe_check(note: Callable[[str], None], served: Callable[[str, str], bool], covers: str) -> Hook:
    """after_load for MoE layers: the runners that `served(runner, a2a)` rejects, and what the hooks do wrap."""

    def unseen(model) -> list[str]:
        a2a = a2a_backend()
        return sorted(r for r in moe_runners(model) if not served(r, a2a))

    def message(names: list[str]) -> str:
        runners = ", ".join(repr(r) for r in names)
        return f"every MoE layer on runner {runners} with a2a {a2a_backend()!r}: our MoE hooks wrap {covers}"

    return after_load(note, unseen, message)
