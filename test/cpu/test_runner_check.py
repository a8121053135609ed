"""sglang_h20.runner_check against the installed sglang: the MoE runners and block-FP8 linear functions a loaded
model resolved to, and the one line swapAB (MoE and dense linears) and SBO give when none of their hooks can see a
layer's calls."""
from __future__ import annotations

import logging
import types

import pytest
import torch

from sglang_h20 import compat, dense_linear, runner_check
from sglang_h20.moe import sbo, swapab
from sglang_h20.settings import Settings


def moe_layer(backend):
    """A real FusedMoE instance (its __init__ needs a distributed world, so only nn.Module's runs) whose quant method
    holds a MoeRunner of `backend` (a MoeRunnerBackend name), or none at all (None)."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    layer = FusedMoE.__new__(FusedMoE)
    torch.nn.Module.__init__(layer)
    runner = None if backend is None else types.SimpleNamespace(runner_backend=MoeRunnerBackend[backend])
    layer.quant_method = types.SimpleNamespace(runner=runner)
    return layer


def model_of(*backends):
    return torch.nn.Sequential(torch.nn.Linear(2, 2), *(moe_layer(b) for b in backends))


def test_the_load_target_resolves_and_runners_are_read_off_the_model():
    assert compat.check_target(runner_check.LOAD_TARGET) == (True, runner_check.LOAD_TARGET)
    assert runner_check.a2a_backend() == "none"  # SGLang's default flags: no all-to-all backend
    assert runner_check.moe_runners(model_of("TRITON", "TRITON", "DEEP_GEMM", None)) == {"triton", "deep_gemm",
                                                                                             runner_check.NO_RUNNER}
    assert runner_check.moe_runners(torch.nn.Linear(2, 2)) == set()  # a dense model: nothing to say
    assert runner_check.block_fp8_linears(model_of("TRITON")) == set()  # no FP8 linear method in it


@pytest.mark.parametrize("feature", ["swapab", "sbo"])
def test_a_runner_our_moe_hooks_cannot_see_is_named_once(feature, monkeypatch, caplog):
    """swapAB serves the triton runner and, under DeepEP, DeepGEMM's masked GEMM; SBO's combine only the triton
    runner. A model loaded onto another runner gets one line per process; the triton runner none."""
    module = {"swapab": swapab, "sbo": sbo}[feature]
    hook = runner_check.moe_check(module._note, module.runner_served, "covers")
    assert (hook.target, hook.kind) == (runner_check.LOAD_TARGET, "after")
    module._note.clear()
    a2a = {"value": "none"}
    monkeypatch.setattr(runner_check, "a2a_backend", lambda: a2a["value"])
    logger = f"sglang_h20.{feature}"
    runner_check._failed.clear()
    with caplog.at_level(logging.INFO):
        for _ in range(2):  # a second runner (or a reload) in the same process adds nothing
            assert hook.fn(None, types.SimpleNamespace(model=model_of("TRITON", "DEEP_GEMM", None))) is None
        assert hook.fn(None, types.SimpleNamespace(model=model_of("TRITON"))) is None
        assert hook.fn(None, types.SimpleNamespace(model=None)) is None  # load_model failed: nothing to read
        broken = torch.nn.Linear(2, 2)
        broken.modules = lambda: (_ for _ in ()).throw(RuntimeError("boom"))  # the check itself fails: one line
        assert hook.fn(None, types.SimpleNamespace(model=broken)) is None
        a2a["value"] = "deepep"
        hook.fn(None, types.SimpleNamespace(model=model_of("DEEP_GEMM")))
    lines = [r.getMessage() for r in caplog.records if r.name == logger]
    first = (f"{feature}: upstream for every MoE layer on runner 'deep_gemm', 'no MoeRunner' with a2a 'none': "
             f"our MoE hooks wrap")
    assert lines[0].startswith(first), lines
    if feature == "swapab":  # DeepGEMM under DeepEP is its masked path: served
        assert len(lines) == 1, lines
    else:
        assert len(lines) == 2 and "runner 'deep_gemm' with a2a 'deepep'" in lines[1], lines
    failed = [r.getMessage() for r in caplog.records if r.name == "sglang_h20.runner_check"]
    assert failed == ["runner check: could not read what the loaded model runs on (RuntimeError: boom); no line "
                      "about it"], failed


def test_both_features_install_the_check(monkeypatch):
    """Each feature's hook list ends with the check (test_swapab_integration and test_sbo pin the whole lists)."""
    monkeypatch.setattr(compat, "gpu", lambda: compat.Gpu("NVIDIA H200", (9, 0), 140.0))
    last = sbo.hooks(Settings.from_env({"SGLANG_H20_SBO": "on"}))[-1]
    assert (last.target, last.kind) == (runner_check.LOAD_TARGET, "after")
    assert sbo.runner_served("triton", "none") and not sbo.runner_served("deep_gemm", "deepep")
    assert swapab.runner_served("deep_gemm", "deepep") and not swapab.runner_served("deep_gemm", "none")


def test_a_block_fp8_linear_our_dense_hooks_cannot_see_is_named_once(caplog):
    """The dense GEMM replaces SGLang's triton and DeepGEMM block-FP8 linears; a model whose linears picked another
    backend's function (cutlass, flashinfer: --fp8-gemm-backend) gets one line, with the function's name."""
    from sglang.srt.layers.quantization import fp8_utils

    def linear(fn):
        m = torch.nn.Linear(2, 2)
        m.quant_method = types.SimpleNamespace(w8a8_block_fp8_linear=fn)
        return m

    ours = torch.nn.Sequential(linear(fp8_utils.triton_w8a8_block_fp8_linear),
                               linear(fp8_utils.deepgemm_w8a8_block_fp8_linear_with_fallback), linear(None))
    other = torch.nn.Sequential(linear(fp8_utils.triton_w8a8_block_fp8_linear),
                                linear(fp8_utils.cutlass_w8a8_block_fp8_linear_with_fallback))
    assert runner_check.block_fp8_linears(ours) == {"triton_w8a8_block_fp8_linear",
                                                    "deepgemm_w8a8_block_fp8_linear_with_fallback"}
    assert dense_linear.unseen_linears(ours) == []
    assert dense_linear.unseen_linears(other) == ["cutlass_w8a8_block_fp8_linear_with_fallback"]
    (hook,) = [h for h in dense_linear.hooks() if h.target == runner_check.LOAD_TARGET]
    dense_linear._note.clear()
    with caplog.at_level(logging.INFO, logger="sglang_h20.dense_linear"):
        for model in (ours, other, other):
            assert hook.fn(None, types.SimpleNamespace(model=model)) is None
    lines = [r.getMessage() for r in caplog.records if r.name == "sglang_h20.dense_linear"]
    assert lines == ["dense linear: upstream for every block-FP8 linear on cutlass_w8a8_block_fp8_linear_with_fallback: "
                     "ours replaces triton_w8a8_block_fp8_linear and deepgemm_w8a8_block_fp8_linear_with_fallback "
                     "(--fp8-gemm-backend triton or deep_gemm)"], lines


def test_doctor_says_what_an_on_feature_needs_from_the_server_flags():
    """`doctor` prints each feature's `needs` under it when it is on (what the startup lines above check), and the
    policy's text names every backend of its SHARED_DISPATCH, so the two cannot drift apart."""
    from sglang_h20 import doctor
    from sglang_h20.attention import mha_mla
    from sglang_h20.features import FEATURES

    by = {f.name: f for f in FEATURES}
    assert all(name in by["mha_mla_policy"].needs for name in mha_mla.SHARED_DISPATCH)
    assert "--enable-eplb" in by["eplb"].needs and "--enable-eplb" in by["eplb_async"].needs
    text, _ = doctor.report(Settings.from_env({"SGLANG_H20_EPLB": "affinity"}))
    lines = text.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("eplb ") and " ON " in ln)
    assert lines[at + 1].split() == ["needs", *by["eplb"].needs.split()]
    off, _ = doctor.report(Settings.from_env({}))
    features = off.split("features (", 1)[1].split("tables and kernels", 1)[0]
    assert "switched off" in features and "needs" not in features  # nothing is on: nothing needed
