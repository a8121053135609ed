"""The swapAB integration (sglang_h20.moe.swapab) against the installed SGLang 0.5.17.

CPU (Triton interpreter), tiny shapes: 4 experts, hidden H = 256, intermediate I = 256 (two 128
scale blocks each way), top-k 2..3, 4..6 tokens, FP8 block-quantized weights from random data.
The hooked forward is called the way SGLang's HookRegistry installs an AROUND hook; upstream's
result comes from calling its fused_experts_impl directly on the same inputs.

Tolerances (measured here: ours vs upstream 0.5-1.2e-2; vs exact 1.4-2.6e-2, upstream 1.5-2.7e-2).
Ours vs upstream: normwise relative difference <= 2.5e-2. Both re-quantize the SiLU*up intermediate
to FP8 (3 mantissa bits), upstream after rounding it to bf16, ours from fp32, so some of its values
land one FP8 step (6-12%) apart. Against a float64 MoE on the dequantized operands with an exact
intermediate: ours <= 4e-2 (the FP8 intermediate alone costs about 2.5e-2) and no worse than
upstream's own error (x1.05 + 1e-3). The interpreter truncates fp32 -> bf16; a GPU rounds.

To run upstream's CPU path, a module fixture stands in for what only a GPU server provides, in
upstream's own module namespace: moe_align_block_size (a CUDA op) by a torch version, the tuned-config
lookup (needs a GPU name) by a fixed config, the runtime-context reads (published ServerArgs) by
stubs, the Triton per-token-group quant by the exact torch one (the interpreter's fp32->fp8
conversion drops mantissa carries), and the interpreter's `__index__` of a scalar (numpy >= 2.3
refuses int() of a 1-element array, which upstream's `range(0, K, BLOCK_K)` needs).
"""
import contextlib
import importlib
import json
import logging
import os
import sys
import types
from pathlib import Path

import torch
# test/conftest.py sets TRITON_INTERPRET=1 before any kernel module is imported when there is no GPU.

import pytest  # noqa: E402

from sgl_kernel_ext import gemm_table  # noqa: E402
from sgl_kernel_ext import grouped_gemm_fp8 as gg  # noqa: E402
from sgl_kernel_ext.quant import (  # noqa: E402
    dequant_per_block, dequant_per_token_group, per_block_quant_fp8, per_token_group_quant_fp8,
)
from sglang_h20 import compat, dense_linear  # noqa: E402
from sglang_h20.features import FEATURES, decide  # noqa: E402
from sglang_h20 import runner_check  # noqa: E402
from sglang_h20.moe import swapab  # noqa: E402
from sglang_h20.settings import Settings  # noqa: E402
from sglang_h20.cliargs import read_json  # noqa: E402

from repo_scripts import REPO  # noqa: E402

sys.path.insert(0, str(REPO / "benchmark" / "kernels"))
import bench_grouped_gemm as bench  # noqa: E402  (the --table-from merge that built the shipped table)

E, H, INTER = 4, 256, 256
REL_UPSTREAM, REL_EXACT, REL_GEMM = 2.5e-2, 4e-2, 1e-2
SHIPPED_RUNS = [next(p for p in (base + ".json", base + ".json.xz") if os.path.isfile(p))  # large ones are xz'd
                for base in (os.path.join(REPO, "benchmark", "results", "swapab", f"grouped_gemm_{name}_h200") for name in (
    "full",  # MoE, every shape
    "dense_tuned",  # the dense linears, tuned
    "tune_bn256_t32_t64",  # MoE retunes at some shapes (a later run replaces those shapes)
    "tune_normal_ppsm2_t64_t128",
    "tune_swapab_ppsm34_uneven_t8_t32",  # swapAB 3/4 per SM at 8-32 tokens, both draws
    "tune_swapab_ppsm34_uneven_t1_t24",  # the same at 1, 2, 4 and 24 tokens (8-32 experts) ...
    "tune_swapab_ppsm34_uneven_t1_t24_g256",  # ... and 256 experts
    "split_s41",  # 16-64 tokens, 8-256 experts, both draws: normal and split measured beside swapab (shipped configs)
    "tune_normal_g32_t64_s41",  # 32 experts x 64 tokens retuned (the run's 256-expert points left out: no uneven draw)
    "tune_maxnreg_s43",  # 8-16 experts x 24-64 tokens: swapAB with registers capped, beside everything (session 43)
    "split_t16_t64_s52"))]  # 16-64 tokens, 8-256 experts: split at one config beside every provider (session 52)


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
def align_reference(topk_ids, block, num_experts, ignore_invalid_expert=False):
    """moe_align_block_size in torch: pairs grouped by expert (filtered -1 pairs as expert -1),
    each group padded to `block` with the pad id P; sizes as upstream's. Entries past
    num_tokens_post_padded hold junk that must never be read."""
    flat = topk_ids.flatten()
    pairs = flat.numel()
    ids, experts = [], []
    for e in [*range(num_experts), -1]:
        rows = (flat == e).nonzero().flatten().tolist()
        if rows:
            padded = -(-len(rows) // block) * block
            ids += rows + [pairs] * (padded - len(rows))
            experts += [e] * (padded // block)
    max_padded = pairs + (num_experts + 1) * (block - 1) if pairs >= num_experts + 1 else pairs * block
    sorted_ids = torch.full((max_padded,), pairs, dtype=torch.int32)
    sorted_ids[:len(ids)] = torch.tensor(ids, dtype=torch.int32)
    expert_ids = torch.full((-(-max_padded // block),), 1 << 20, dtype=torch.int32)  # junk: out of range
    expert_ids[:len(experts)] = torch.tensor(experts, dtype=torch.int32)
    return sorted_ids, expert_ids, torch.tensor([len(ids)], dtype=torch.int32)


def write_table(path, entries, gpu="test"):
    path.write_text(json.dumps({"gpu": gpu, "measured": False, "date": "test", "entries": entries}))
    return path


def tiny_entries(best="swapab", groups=(4,), ms=(1, 2, 4, 8), config=None):
    return [{"n": n, "k": k, "groups": g, "m": m, "layout": "contiguous", "best": best,
             "config": {best: config} if config else {}}
            for n, k in ((2 * INTER, H), (H, INTER)) for g in groups for m in ms]


@pytest.fixture(autouse=True)
def isolated_tables(monkeypatch, tmp_path, no_gemm_table):
    """No user cache or shipped table leaks in; each test sets its own; decisions start fresh."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    swapab.reset()
    yield
    swapab.reset()


def use_table(monkeypatch, path):
    monkeypatch.setenv("SGLANG_H20_GEMM_TABLE", str(path))
    swapab.reset()


@pytest.fixture(scope="module")
def upstream():
    """Upstream's Triton MoE module, runnable on CPU (see the module docstring for each stand-in)."""
    from interpreter_compat import allow_scalar_index

    fm = importlib.import_module(swapab.TRITON_MOE_MODULE)
    fmk = importlib.import_module(swapab.QUANT_KERNELS_MODULE)
    config = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 128, "GROUP_SIZE_M": 1,
              "num_warps": 4, "num_stages": 2}
    exec_stub = types.SimpleNamespace(moe=types.SimpleNamespace(enable_fused_moe_sum_all_reduce=False))
    with pytest.MonkeyPatch.context() as mp:
        allow_scalar_index(mp)
        mp.setattr(fm, "moe_align_block_size", align_reference)
        mp.setattr(fm, "try_get_optimal_moe_config", lambda *a, **k: (dict(config), (None, None)))
        mp.setattr(fm, "get_exec", lambda: exec_stub)
        mp.setattr(fm, "is_allocation_symmetric", lambda: False)
        mp.setattr(fm, "get_tp_group", lambda: None)
        mp.setattr(fm, "use_symmetric_memory", lambda *a, **k: contextlib.nullcontext())
        mp.setattr(fmk, "per_token_group_quant_fp8", lambda x, group, **k: per_token_group_quant_fp8(x, group))
        yield fm


def make_moe(seed, tokens, top_k, filtered=0):
    """FP8 block-quantized experts and a routing; `filtered` pairs get expert -1 (EP: not local), and then every
    pair of the first token too (a token none of whose experts is local)."""
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, 2 * INTER, H, generator=g) * 0.06 * torch.exp(torch.randn(E, 1, H, generator=g) * 0.5)
    w2 = torch.randn(E, H, INTER, generator=g) * 0.06
    w1q, w1s = per_block_quant_fp8(w1)
    w2q, w2s = per_block_quant_fp8(w2)
    x = (torch.randn(tokens, H, generator=g) * torch.exp(torch.randn(tokens, 1, generator=g))).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
    if filtered:
        ids.view(-1)[torch.randperm(ids.numel(), generator=g)[:filtered]] = -1
        ids[0] = -1
    w = torch.rand(tokens, top_k, generator=g) + 0.1
    return x, w1q, w1s, w2q, w2s, w, ids


def moe_reference(x, w1q, w1s, w2q, w2s, w, ids, scale=1.0, a1=None):
    """float64 MoE on the dequantized operands, the intermediate kept exact (not re-quantized)."""
    xq, xs = a1 if a1 is not None else per_token_group_quant_fp8(x)
    xd = dequant_per_token_group(xq, xs).double()
    w1d, w2d = dequant_per_block(w1q, w1s).double(), dequant_per_block(w2q, w2s).double()
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= 0:
                h = xd[t] @ w1d[e].T
                out[t] += float(w[t, j]) * scale * ((torch.nn.functional.silu(h[:INTER]) * h[INTER:]) @ w2d[e].T)
    return out


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def hooked(fm):
    """fused_experts as SGLang's HookRegistry wraps it with our AROUND hook (not installed globally)."""
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    return _wrap_fn(fm.fused_experts, swapab.fused_experts_hook, HookType.AROUND)


def runner_config(top_k, inplace, scale=None, num_experts=E):
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    return MoeRunnerConfig(num_experts=num_experts, num_local_experts=E, top_k=top_k, inplace=inplace,
                           routed_scaling_factor=scale)


def call(fn, x, w1q, w1s, w2q, w2s, w, ids, cfg, **kw):
    """The call fused_experts_none_to_triton makes (keywords after the first five)."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    return fn(x, w1q, w2q, StandardTopKOutput(w, ids, None), moe_runner_config=cfg, use_fp8_w8a8=True,
              w1_scale=w1s, w2_scale=w2s, block_shape=[128, 128], **kw)


def upstream_reference(fm, x, w1q, w1s, w2q, w2s, w, ids, cfg, a1_q=None, a1_scale=None):
    """Upstream's fused_experts, by its body fused_experts_impl (the custom-op wrapper in between is
    registered for CUDA only), with the arguments fused_experts derives from the runner config."""
    return fm.fused_experts_impl(
        x, w1q, w2q, w, ids, inplace=cfg.inplace, activation=cfg.activation, is_gated=cfg.is_gated,
        use_fp8_w8a8=True, w1_scale=w1s, w2_scale=w2s, a1_scale=a1_scale, block_shape=[128, 128],
        no_combine=cfg.no_combine, routed_scaling_factor=cfg.routed_scaling_factor,
        filter_expert=cfg.num_experts is None or cfg.num_experts != cfg.num_local_experts, a1_q=a1_q)


@pytest.fixture
def spy_aligned(monkeypatch):
    calls = []
    real = gg.m_grouped_fp8_gemm_nt_aligned

    def spy(*args, **kwargs):
        calls.append(kwargs.get("variant"))
        return real(*args, **kwargs)

    monkeypatch.setattr(gg, "m_grouped_fp8_gemm_nt_aligned", spy)
    return calls


# ---------------------------------------------------------------------------------------------
# Wiring against the installed SGLang
# ---------------------------------------------------------------------------------------------
def test_hook_targets_resolve_and_take_upstreams_parameters():
    from hook_checks import assert_hook_takes_upstreams_parameters

    for target, hook in ((swapab.TRITON_MOE, swapab.fused_experts_hook),
                         (swapab.DEEPEP_MASKED, swapab.masked_gemm_hook)):
        assert_hook_takes_upstreams_parameters(target, hook)
    # the masked wrapper is what the DeepEP runner calls, through the package
    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.layers.deep_gemm_wrapper import entrypoint
    assert deep_gemm_wrapper.grouped_gemm_nt_f8f8bf16_masked is entrypoint.grouped_gemm_nt_f8f8bf16_masked


def test_feature_points_at_this_module_and_needs_a_gpu():
    feature = next(f for f in FEATURES if f.name == "swapab")
    assert feature.module == "sglang_h20.moe.swapab" and feature.needs_gpu
    d = decide(feature, Settings.from_env({"SGLANG_H20_SWAPAB": "on"}))
    if compat.gpu() is None:
        assert not d.on and "no CUDA GPU visible" in d.reason and "upstream behaviour kept" in d.reason
    assert not decide(feature, Settings.from_env({})).on


def test_hooks_need_a_table_for_this_gpu(monkeypatch, tmp_path, caplog):
    """No table: no hooks, and the reason is the feature's one line (hooks() logs nothing itself); with one, the
    table in force is said once the feature is on (enabled())."""
    from sglang_h20.features import Unsupported

    caplog.set_level(logging.INFO, logger="sglang_h20.swapab")
    with pytest.raises(Unsupported, match="no grouped-GEMM table.*--tune"):
        swapab.hooks(Settings.from_env({}))
    assert not caplog.records
    entries = tiny_entries() + tiny_entries("upstream", groups=(8,), ms=(1, 2))
    use_table(monkeypatch, write_table(tmp_path / "t.json", entries))
    hooks = swapab.hooks(Settings.from_env({}))
    assert [(h.target, h.kind) for h in hooks] == [(swapab.TRITON_MOE, "around"), (swapab.DEEPEP_MASKED, "around"),
                                                   (dense_linear.TRITON_LINEAR, "around"),
                                                   (dense_linear.DEEPGEMM_LINEAR, "around"),
                                                   (runner_check.LOAD_TARGET, "after"),
                                                   (runner_check.LOAD_TARGET, "after")]
    assert [h.fn for h in hooks[2:4]] == [dense_linear.triton_linear_hook, dense_linear.deepgemm_linear_hook]
    assert not caplog.records
    swapab.enabled(Settings.from_env({}))
    assert len(caplog.records) == 1 and "t.json" in caplog.records[0].getMessage()
    assert "12 entries (0 dense linears), ours fastest at 8;" in caplog.records[0].getMessage()  # 4 say upstream


# ---------------------------------------------------------------------------------------------
# The hooked Triton MoE forward against upstream's
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", [
    dict(tokens=5, top_k=2, inplace=False, variant="swapab"),
    dict(tokens=4, top_k=3, inplace=True, scale=2.5, variant="swapab", prequant=True),
    dict(tokens=6, top_k=2, inplace=False, variant="normal", filtered=3),
], ids=["swapab", "inplace-scaled-prequant", "normal-ep-filtered"])
def test_hooked_moe_matches_upstream(case, upstream, monkeypatch, tmp_path, spy_aligned):
    use_table(monkeypatch, write_table(tmp_path / "t.json", tiny_entries(case["variant"])))
    x, w1q, w1s, w2q, w2s, w, ids = make_moe(seed=case["tokens"], tokens=case["tokens"], top_k=case["top_k"],
                                             filtered=case.get("filtered", 0))
    scale, inplace = case.get("scale"), case["inplace"]
    num_experts = 2 * E if case.get("filtered") else E  # EP: the runner filters non-local experts
    cfg = runner_config(case["top_k"], inplace, scale, num_experts)
    kw, a1 = {}, None
    if case.get("prequant"):  # SGLANG_OPT_MOE_QUANT_ONCE: the caller's fp8 copy, column-major scales
        xq, xs = per_token_group_quant_fp8(x)
        a1 = (xq, xs)
        kw = dict(a1_q=xq, a1_scale=xs.t().contiguous().t())

    x_ours, x_up = x.clone(), x.clone()
    ours = call(hooked(upstream), x_ours, w1q, w1s, w2q, w2s, w, ids, cfg, **kw)
    assert spy_aligned == [case["variant"]] * 2, "our kernels did not run"
    ref = upstream_reference(upstream, x_up, w1q, w1s, w2q, w2s, w, ids, cfg, **kw)
    if inplace:
        assert ours is x_ours and ref is x_up
    else:
        assert torch.equal(x_ours, x)
    assert ours.dtype == torch.bfloat16 and ours.shape == x.shape and torch.isfinite(ours).all()
    exact = moe_reference(x, w1q, w1s, w2q, w2s, w, ids, 1.0 if scale is None else scale, a1)
    err_ours, err_up = rel(ours, exact), rel(ref, exact)
    assert rel(ours, ref) <= REL_UPSTREAM, f"ours vs upstream {rel(ours, ref):.3e}"
    assert err_ours <= REL_EXACT and err_ours <= 1.05 * err_up + 1e-3, (err_ours, err_up)
    if case.get("filtered"):  # a token whose every slot is filtered gets exactly zero (make_moe made one at least)
        none_local = [t for t in range(ids.shape[0]) if (ids[t] < 0).all()]
        assert none_local and all((ours[t] == 0).all() for t in none_local), none_local
        assert all((ours[t] != 0).any() for t in range(ids.shape[0]) if t not in none_local)


def test_no_host_sync_in_our_sequence(upstream, monkeypatch, tmp_path):
    """CPU stand-in for CUDA-graph safety: our sequence never reads a tensor value on the host
    (the alignment stand-in itself does, so it runs with the guard lifted, as a CUDA op would)."""
    use_table(monkeypatch, write_table(tmp_path / "t.json", tiny_entries()))
    x, w1q, w1s, w2q, w2s, w, ids = make_moe(seed=3, tokens=5, top_k=2)
    guard = {"on": True}

    def forbid(name):
        real = getattr(torch.Tensor, name)

        def fn(self, *a, **k):
            if guard["on"]:
                raise AssertionError(f"host sync: Tensor.{name}")
            return real(self, *a, **k)
        return fn

    def align_unguarded(*a, **k):
        guard["on"] = False
        try:
            return align_reference(*a, **k)
        finally:
            guard["on"] = True

    plan = swapab.plan_moe(5, 2, E, H, INTER)  # the decision: host integers only
    assert plan is not None and plan.variant == "swapab"
    monkeypatch.setattr(upstream, "moe_align_block_size", align_unguarded)
    with pytest.MonkeyPatch.context() as mp:
        for name in ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy",
                     "__array__"):
            mp.setattr(torch.Tensor, name, forbid(name))
        out = swapab.moe_forward(plan, x, w1q, w2q, w, ids, w1s, w2s)
    assert torch.isfinite(out).all()
    # and the guarded sequence computed the MoE (not, say, an early exit that reads nothing)
    assert rel(out, moe_reference(x, w1q, w1s, w2q, w2s, w, ids)) <= REL_EXACT


# ---------------------------------------------------------------------------------------------
# Fallbacks: upstream runs unchanged, each reason logged once
# ---------------------------------------------------------------------------------------------
def recording_original(calls):
    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "upstream"
    return original


def test_fallbacks_call_upstream_unchanged_and_log_once(monkeypatch, tmp_path, caplog, spy_aligned):
    caplog.set_level(logging.INFO, logger="sglang_h20.swapab")
    use_table(monkeypatch, write_table(tmp_path / "t.json", tiny_entries()))
    x, w1q, w1s, w2q, w2s, w, ids = make_moe(seed=1, tokens=4, top_k=2)
    cfg = runner_config(2, False)
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    topk = StandardTopKOutput(w, ids, None)
    cases = {
        "block shape": dict(block_shape=[64, 64]),
        "not FP8": dict(use_fp8_w8a8=False, use_int8_w8a8=True),
        "fp32 scales": dict(w1_scale=w1s.to(torch.bfloat16)),
        "w1 scales not per 128x128 block": dict(w1_scale=w1s.repeat(1, 2, 1)),  # each scale check alone
        "w2 scales not per 128x128 block": dict(w2_scale=w2s.repeat(1, 1, 2)),
        "biases": dict(b1=torch.zeros(E, 2 * INTER)),
        "pre-quantized without scales": dict(a1_q=x.to(torch.float8_e4m3fn)),
        "pre-quantized in bf16": dict(a1_q=x, a1_scale=torch.ones(x.shape[0], H // 128)),
    }
    for why, change in cases.items():
        kw = {**dict(use_fp8_w8a8=True, w1_scale=w1s, w2_scale=w2s, block_shape=[128, 128]), **change}
        for _ in range(2):
            calls = []
            assert swapab.fused_experts_hook(recording_original(calls), x, w1q, w2q, topk, cfg, **kw) == "upstream"
            (args, kwargs), = calls
            assert args[0] is x and args[3] is topk and args[4] is cfg
            for k, v in kw.items():
                assert kwargs[k] is v, (why, k)
    for k in ("activation", "no_combine"):
        calls = []
        bad = runner_config(2, False)
        setattr(bad, k, "gelu" if k == "activation" else True)
        swapab.fused_experts_hook(recording_original(calls), x, w1q, w2q, topk, bad, use_fp8_w8a8=True,
                                  w1_scale=w1s, w2_scale=w2s, block_shape=[128, 128])
        assert len(calls) == 1
    lines = [r.getMessage() for r in caplog.records]
    # once per reason: the two pre-quantized cases share one
    assert len(lines) == len(cases) + 1 and len(set(lines)) == len(lines), lines
    assert spy_aligned == []


def test_activation_dtype_and_rank_are_each_checked_and_torch_compile_goes_upstream(monkeypatch, tmp_path, caplog):
    """fp16 2-D activations and bf16 3-D ones are each refused (either alone is enough), so is each shape our kernels
    do not take, and under torch.compile the call goes upstream with that reason, not with another."""
    caplog.set_level(logging.INFO, logger="sglang_h20.swapab")
    x, w1q, w1s, w2q, w2s, w, ids = make_moe(seed=2, tokens=4, top_k=2)
    cfg = runner_config(2, False)
    args = (cfg, None, None, True, False, False, False, False, w1s, w2s, [128, 128], None, None)
    assert swapab.moe_unsupported(x, w1q, w2q, ids, *args) is None
    assert "dtype torch.float16, 2-D" in swapab.moe_unsupported(x.half(), w1q, w2q, ids, *args)
    assert "dtype torch.bfloat16, 3-D" in swapab.moe_unsupported(x[None], w1q, w2q, ids, *args)
    fp8 = lambda *shape: torch.empty(*shape, dtype=torch.float8_e4m3fn)  # noqa: E731  (host-side checks only)
    for w1, w2, hidden in ((fp8(E, 2 * INTER, 192), fp8(E, 192, INTER), 192),  # K not whole 128-blocks
                           (fp8(E, 2 * 192, H), fp8(E, H, 192), H),  # intermediate not whole blocks
                           (w1q, w2q, H + 128),  # activations wider than the weights' K
                           (w1q, fp8(E, H, 2 * INTER), H)):  # down weights of another intermediate size
        got = swapab.moe_unsupported(torch.zeros(4, hidden, dtype=torch.bfloat16), w1, w2, ids, *args)
        assert got == f"MoE shapes w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}"
    use_table(monkeypatch, write_table(tmp_path / "t.json", tiny_entries()))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    calls = []
    r = swapab.fused_experts_hook(recording_original(calls), x, w1q, w2q, StandardTopKOutput(w, ids, None), cfg,
                                  use_fp8_w8a8=True, w1_scale=w1s, w2_scale=w2s, block_shape=[128, 128])
    assert r == "upstream" and len(calls) == 1
    assert any("MoE under torch.compile" in rec.getMessage() for rec in caplog.records), caplog.text


def test_table_decides_and_missing_table_means_upstream(upstream, monkeypatch, tmp_path, spy_aligned):
    x, w1q, w1s, w2q, w2s, w, ids = make_moe(seed=2, tokens=4, top_k=2)
    cfg = runner_config(2, False)
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    topk = StandardTopKOutput(w, ids, None)
    kw = dict(use_fp8_w8a8=True, w1_scale=w1s, w2_scale=w2s, block_shape=[128, 128])
    for entries in (None, tiny_entries("upstream"), tiny_entries(ms=(64, 128)),  # m ~2: too far from 64
                    [e for e in tiny_entries() if e["n"] == H]):  # gate_up not measured
        if entries is not None:
            use_table(monkeypatch, write_table(tmp_path / "t.json", entries))
        else:
            swapab.reset()
        calls = []
        assert swapab.fused_experts_hook(recording_original(calls), x, w1q, w2q, topk, cfg, **kw) == "upstream"
        assert len(calls) == 1
    assert spy_aligned == []


# ---------------------------------------------------------------------------------------------
# Masked path (DeepEP low latency)
# ---------------------------------------------------------------------------------------------
def masked_inputs(seed, groups=3, max_m=8, n=256, k=256):
    g = torch.Generator().manual_seed(seed)
    a, a_s = per_token_group_quant_fp8(torch.randn(groups, max_m, k, generator=g))
    b, b_s = per_block_quant_fp8(torch.randn(groups, n, k, generator=g) * 0.05)
    masked_m = torch.tensor([3, 0, 8][:groups], dtype=torch.int32)
    out = torch.full((groups, max_m, n), float("nan"), dtype=torch.bfloat16)
    return (a, a_s.transpose(1, 2).contiguous().transpose(1, 2)), (b, b_s), out, masked_m


def masked_table(tmp_path, best):
    return write_table(tmp_path / "m.json", [{"n": 256, "k": 256, "groups": 3, "m": m, "layout": "masked",
                                              "best": best} for m in (2, 4, 8)])


def test_masked_hook_runs_ours_where_the_table_says(monkeypatch, tmp_path):
    use_table(monkeypatch, masked_table(tmp_path, "swapab"))
    lhs, rhs, out, masked_m = masked_inputs(5)
    calls = []
    assert swapab.masked_gemm_hook(recording_original(calls), lhs, rhs, out, masked_m, 4) is None
    assert calls == []
    ref = gg.grouped_gemm_reference(lhs[0], lhs[1], rhs[0], rhs[1], masked_m=masked_m)
    for g, m in enumerate(masked_m.tolist()):
        if m:
            assert rel(out[g, :m], ref[g, :m]) <= REL_GEMM
        assert out[g, m:].isnan().all()


def test_masked_hook_reads_the_one_token_entry_for_an_expected_m_of_0_or_1(monkeypatch, tmp_path):
    """DeepEP's expected_m is 0 or 1 at a one-token decode: both read the table's m = 1 entry (ours here), while 2
    reads m = 2 (upstream here)."""
    entries = [{"n": 256, "k": 256, "groups": 3, "m": m, "layout": "masked", "best": "swapab" if m == 1 else "upstream"}
               for m in (1, 2, 4, 8)]
    use_table(monkeypatch, write_table(tmp_path / "one.json", entries))
    lhs, rhs, out, masked_m = masked_inputs(9)
    for expected_m, ours in ((0, True), (1, True), (2, False)):
        calls = []
        got = swapab.masked_gemm_hook(recording_original(calls), lhs, rhs, out, masked_m, expected_m)
        assert (got is None and calls == []) if ours else (got == "upstream" and len(calls) == 1), expected_m


def test_masked_hook_runs_the_split_variant_with_the_tables_boundary(monkeypatch, tmp_path):
    """An entry whose best is 'split' (swapAB below split_at tokens, normal above): the hook runs both launches with
    the table's boundary, and every group is right (one light, one empty, one heavy group here)."""
    entries = [{"n": 256, "k": 256, "groups": 3, "m": m, "layout": "masked", "best": "split",
                "config": {"split": {"split_at": 4}}} for m in (2, 4, 8)]
    use_table(monkeypatch, write_table(tmp_path / "s.json", entries))
    lhs, rhs, out, masked_m = masked_inputs(8)
    launches = []
    real = gg._launch
    monkeypatch.setattr(gg, "_launch", lambda *a, **kw: launches.append((kw["variant"], kw["count_range"]))
                        or real(*a, **kw))
    assert swapab.masked_gemm_hook(recording_original([]), lhs, rhs, out, masked_m, 4) is None
    assert launches == [("swapab", (-1, 4)), ("normal", (4, 1 << 30))]
    ref = gg.grouped_gemm_reference(lhs[0], lhs[1], rhs[0], rhs[1], masked_m=masked_m)
    for g, m in enumerate(masked_m.tolist()):
        if m:
            assert rel(out[g, :m], ref[g, :m]) <= REL_GEMM
        assert out[g, m:].isnan().all()


def test_masked_hook_falls_back(monkeypatch, tmp_path):
    lhs, rhs, out, masked_m = masked_inputs(6)
    packed = (lhs[0], lhs[1].to(torch.int32))  # UE8M0-packed scales
    cases = [("upstream", dict(), lhs),  # the table says upstream
             ("swapab", dict(overlap_args=object()), lhs),  # SBO's overlap signal: DeepGEMM's only
             ("swapab", dict(recipe_a=(1, 128)), lhs),
             ("swapab", dict(), packed)]
    for best, kwargs, lhs_ in cases:
        use_table(monkeypatch, masked_table(tmp_path, best))
        calls = []
        assert swapab.masked_gemm_hook(recording_original(calls), lhs_, rhs, out, masked_m, 4, **kwargs) == "upstream"
        (args, kw), = calls
        assert args[0] is lhs_ and args[1] is rhs and args[4] == 4
        assert kw["overlap_args"] is kwargs.get("overlap_args") and kw["recipe_a"] == kwargs.get("recipe_a")
    assert out.isnan().all()
    (a, a_s), (b, b_s) = lhs, rhs
    other = {  # each check of masked_unsupported alone: an input the kernel cannot take goes upstream as it came
        "fp16 out": (lhs, rhs, out.half(), masked_m),
        "int64 counts": (lhs, rhs, out, masked_m.long()),
        "2-D weights": (lhs, (b[0], b_s[0]), out, masked_m),
        "per-tensor activation scale": ((a, a_s[:, :, :1]), rhs, out, masked_m),
        "per-channel weight scale": (lhs, (b, b_s[:, :1, :]), out, masked_m),
        "out of another width": (lhs, rhs, out[:, :, :128], masked_m),
    }
    use_table(monkeypatch, masked_table(tmp_path, "swapab"))
    for why, args in other.items():
        assert swapab.masked_unsupported(*args, None, None, None), why
        calls = []
        assert swapab.masked_gemm_hook(recording_original(calls), *args, 4) == "upstream", why
        (got, _), = calls
        assert all(x is y for x, y in zip(got, args)), why
    assert out.isnan().all()
    lhs2, rhs2, out2, mm2 = masked_inputs(7, n=128)  # a shape the table does not hold (e.g. MLA's bmm)
    calls = []
    swapab.masked_gemm_hook(recording_original(calls), lhs2, rhs2, out2, mm2, 4)
    assert len(calls) == 1


# ---------------------------------------------------------------------------------------------
# Table lookup
# ---------------------------------------------------------------------------------------------
def grid_entries(best_of, layout="contiguous", n=4096, k=7168):
    return [{"n": n, "k": k, "groups": g, "m": m, "layout": layout, "best": best_of(g, m),
             "config": {"swapab": {"BLOCK_T": 16 if m <= 16 else 32}}}
            for g in (8, 32) for m in (1, 8, 32, 128)]


def test_lookup_keeps_the_layout_asked_for(monkeypatch, tmp_path):
    """'auto' (gemm_table.lookup): an entry measured for another layout is never used; one without a layout
    serves both; layout None takes any."""
    entries = (grid_entries(lambda g, m: "swapab") + grid_entries(lambda g, m: "normal", layout="masked")
               + [{"n": 4096, "k": 7168, "groups": 8, "m": 256, "best": "split"}])  # no layout
    use_table(monkeypatch, write_table(tmp_path / "t.json", entries))
    look = lambda m, layout: gemm_table.lookup(m, 4096, 7168, 8, "test", layout)  # noqa: E731
    assert look(8, "contiguous")["best"] == "swapab" and look(8, "masked")["best"] == "normal"
    assert look(200, "contiguous")["best"] == look(200, "masked")["best"] == "split"
    assert look(8, None)["best"] in ("swapab", "normal")
    assert gemm_table.lookup(8, 4096, 7168, 8, "test", "other")["best"] == "split"  # only the layoutless entry
    assert gemm_table.lookup(8, 4096, 2048, 8, "test", "masked") is None  # no entry for (N, K)


def test_table_choice_rounds_to_nearest_and_defaults_to_upstream(monkeypatch, tmp_path):
    best = {(8, 1): "swapab", (8, 8): "swapab", (8, 32): "upstream", (8, 128): "normal",
            (32, 1): "upstream", (32, 8): "swapab", (32, 32): "swapab", (32, 128): "swapab"}
    entries = grid_entries(lambda g, m: best[g, m]) + grid_entries(lambda g, m: "swapab", layout="masked")
    use_table(monkeypatch, write_table(tmp_path / "t.json", entries))

    def tc(m, g, layout="contiguous", n=4096, k=7168):
        return gemm_table.table_choice(m, n, k, g, layout, "test").best

    assert tc(8, 8) == "swapab" and tc(32, 8) == "upstream" and tc(128, 8) == "normal"  # measured points
    assert tc(6, 8) == "swapab" and tc(11, 8) == "swapab" and tc(20, 8) == "upstream"  # nearest m (log2)
    assert tc(8, 11) == "swapab" and tc(1, 11) == "swapab" and tc(1, 23) == "upstream"  # nearest groups
    assert tc(8, 16) == "swapab"  # 16 is between 8 and 32: both measured swapab
    assert tc(1, 16) == "upstream" and tc(32, 16) == "upstream"  # neighbours disagree: unsure
    assert tc(128, 16) == "upstream" and tc(128, 32) == "swapab"  # normal at 8 groups, swapab at 32: two of ours
    assert tc(2.83, 8) == "upstream" and tc(2, 8) == "swapab"  # 2.83 is over 2x from both m = 1 and 8
    assert tc(16, 8) == "upstream"  # halfway between m = 8 (swapab) and 32 (upstream)
    assert tc(256, 8) == "normal" and tc(257, 8) == "upstream"  # over 2x beyond the largest m
    assert tc(8, 4) == "swapab" and tc(8, 3.9) == "upstream" and tc(8, 65) == "upstream"  # groups: same rule
    assert tc(8, 8, n=4096, k=2048) == "upstream"  # shape not measured
    assert tc(32, 8, layout="masked") == "swapab"  # layouts are kept apart
    assert tc(32, 8, layout="dense") == "upstream"
    choice = gemm_table.table_choice(8, 4096, 7168, 8, "contiguous", "test")
    assert choice.config == {"BLOCK_T": 16} and "measured best swapab" in choice.why
    monkeypatch.setenv("SGLANG_H20_GEMM_TABLE", str(tmp_path / "none.json"))
    assert gemm_table.table_choice(8, 4096, 7168, 8, "contiguous", "test") == (
        "upstream", None, "no grouped-GEMM table for test")


def test_plan_moe_needs_both_gemms_and_uses_expected_load(monkeypatch, tmp_path):
    active, m = swapab.expected_load(16, 8, 16)  # 128 pairs over 16 experts: all active, 8 each
    assert 15.9 < active <= 16 and 7.9 < m < 8.1
    active, m = swapab.expected_load(1, 8, 256)  # decode of one token: 8 experts, 1 token each
    assert 7.8 < active < 8 and 1 <= m < 1.02
    up = lambda g, m: "swapab" if m <= 8 else "upstream"  # noqa: E731
    entries = grid_entries(up) + grid_entries(lambda g, m: "swapab" if m <= 1 else "upstream", n=7168, k=2048)
    use_table(monkeypatch, write_table(tmp_path / "t.json", entries))
    plan = swapab.plan_moe(1, 8, 32, 7168, 2048)  # m ~1: both GEMMs say swapab
    assert plan is not None and plan.variant == "swapab" and plan.block_t == 16
    assert swapab.plan_moe(32, 8, 32, 7168, 2048) is None  # m = 8: down says upstream
    assert swapab.plan_moe(1, 8, 32, 7168, 1024) is None  # down shape not measured


def test_plan_moe_leaves_split_to_upstream(monkeypatch, tmp_path):
    """'split' is two launches by count; the single-GPU runner's aligned kernel has one walk: upstream runs."""
    use_table(monkeypatch, write_table(tmp_path / "t.json", tiny_entries(best="split", config={"split_at": 4})))
    assert swapab.plan_moe(5, 2, E, H, INTER) is None


@pytest.mark.parametrize("walk", ["flat", "tma", "ws"])
def test_plan_moe_trusts_only_times_of_the_walk_it_runs(monkeypatch, tmp_path, walk):
    """The single-GPU MoE runs the aligned kernel, which has the group walk only: an entry measured on another walk
    (a re-tune may pick flat, tma or ws for the contiguous layout) says nothing about it, so upstream runs."""
    use_table(monkeypatch, write_table(tmp_path / "t.json", tiny_entries(config={"BLOCK_T": 16})))
    assert swapab.plan_moe(5, 2, E, H, INTER) is not None  # the group walk's time: ours
    use_table(monkeypatch, write_table(tmp_path / "w.json", tiny_entries(config={"BLOCK_T": 16, walk: True})))
    assert swapab.plan_moe(5, 2, E, H, INTER) is None


def test_user_retune_comes_before_the_shipped_table(monkeypatch, tmp_path):
    monkeypatch.delenv("SGLANG_H20_GEMM_TABLE")
    assert gemm_table.find_table("NVIDIA H200") == gemm_table.table_path("NVIDIA H200")  # shipped
    assert gemm_table.table_path("NVIDIA H200").exists()
    user = gemm_table.user_table_path("NVIDIA H200")
    assert user == tmp_path / "cache" / "sglang_h20" / "grouped_gemm_h200.json"
    user.parent.mkdir(parents=True)
    write_table(user, tiny_entries(), gpu="NVIDIA H200")
    # a process looks at the files again after TABLE_RECHECK_S (each GEMM call asks), or at once when told to
    assert gemm_table.find_table("NVIDIA H200") == gemm_table.table_path("NVIDIA H200")
    monkeypatch.setattr(gemm_table, "TABLE_RECHECK_S", 0.0)
    assert gemm_table.find_table("NVIDIA H200") == user
    monkeypatch.setattr(gemm_table, "TABLE_RECHECK_S", 60.0)
    gemm_table.forget_tables()
    assert gemm_table.find_table("NVIDIA H200") == user and gemm_table.load_table("NVIDIA H200")["path"] == str(user)
    # nothing shipped for H20
    assert gemm_table.find_table("NVIDIA H20") is None and gemm_table.load_table("NVIDIA H20") is None


def shipped_table_file(gpu: str) -> dict:
    """The shipped table file of `gpu`, as committed."""
    return json.loads(Path(gemm_table.find_table(gpu)).read_text())


def rebuilt_table_file(runs, shipped: dict, monkeypatch) -> dict:
    """What `bench_grouped_gemm.py --table-from` writes from `runs` (named from the checkout's root, as they were),
    given the shipped file's own results file and command: provenance, date, rule and entries included."""
    monkeypatch.chdir(REPO)
    source = shipped["source"]
    merged = bench.merged_results([Path(os.path.relpath(p, REPO)) for p in runs])
    return gemm_table.table_from_result(merged, source["results_file"], source["table_command"])


def test_shipped_h200_table_is_the_measured_run(monkeypatch):
    monkeypatch.delenv("SGLANG_H20_GEMM_TABLE")
    table = gemm_table.load_table("NVIDIA H200")
    runs = [read_json(path, "shipped run") for path in SHIPPED_RUNS]
    assert table["gpu"] == "NVIDIA H200" and {r["provenance"]["gpu"] for r in runs} == {"NVIDIA H200"}
    assert table["measured"] is True and table["date"] == max(r["provenance"]["date"] for r in runs)  # the latest
    assert table["source"]["benchmark_command"] == runs[0]["provenance"]["command"]
    assert "--table-from" in table["source"]["table_command"]
    assert [m["provenance"] for m in table["source"]["merged_from"]] == [r["provenance"] for r in runs]
    # rebuilt from the recorded points of those runs, the later one's wherever two measured a shape
    shipped = shipped_table_file("NVIDIA H200")
    rebuilt_file = rebuilt_table_file(SHIPPED_RUNS, shipped, monkeypatch)
    rebuilt = rebuilt_file["entries"]
    assert rebuilt_file == shipped
    # shipped in session 59 after its end to end on an H200 (swapab/swapab_e2e_candidate_*_s59_h200.json)
    assert table["entries"] == rebuilt and len(rebuilt) == 205 and sum(e["best"] != "upstream" for e in rebuilt) == 98
    dc = lambda m, n, k, against: gemm_table.table_choice(  # noqa: E731
        m, n, k, 1, "dense", "NVIDIA H200", against).best
    assert dc(16, 2112, 7168, None) == "swapab"  # q_a+kv_a: 13.5 us vs DeepGEMM 14.7, Triton 39.4
    assert dc(64, 7168, 16384, None) == "upstream"  # o_proj: DeepGEMM 43.8 vs ours 50.2 ...
    assert dc(64, 7168, 16384, "sglang-triton") == "swapab"  # ... but the Triton GEMM takes 70.6
    assert dc(64, 7168, 16384, "deepgemm") == "upstream"
    tc = lambda m, n, k, g, layout: gemm_table.table_choice(m, n, k, g, layout, "NVIDIA H200").best  # noqa: E731
    assert tc(1, 4096, 7168, 32, "masked") == "swapab"  # 222.9 us vs 240.1 (uneven 105.1 vs 114.3)
    assert tc(2, 4096, 7168, 16, "masked") == "swapab"  # retuned on both draws: 121.4 vs 131.9, uneven 103.1 vs 113.6
    assert tc(24, 7168, 2048, 256, "masked") == "normal"  # 923.4 vs 935.2, uneven 1003.7 vs 1062.5 (swapAB 1152.4)
    assert tc(128, 4096, 7168, 32, "masked") == "upstream"  # 324.5 (normal, two per SM) vs 282.2
    assert tc(8, 4096, 7168, 8, "contiguous") == "swapab"  # 128 x 16 three per SM: 71.4 vs 73.0, uneven 72.9 vs 73.0
    assert tc(8, 7168, 2048, 16, "contiguous") == "upstream"  # uniform win (71.6 vs 72.3), the uneven draw loses
    assert tc(8, 4096, 7168, 16, "masked") == "upstream"  # one config for both draws: 126.4 vs 125.9 uniform
    assert tc(32, 4096, 7168, 32, "masked") == "normal"  # 236.8 vs 238.8, uneven 242.4 vs 256.2 (session 41)
    # 32 x 64 retuned (session 41, normal two per SM), then session 52's split run replaced these points
    assert tc(64, 7168, 2048, 32, "contiguous") == "split"  # 133.0 vs 148.8, uneven 156.1 vs 166.3
    assert tc(64, 7168, 2048, 32, "masked") == "normal"  # 133.1 vs DeepGEMM 135.9, uneven 153.8 vs 160.4
    assert tc(64, 4096, 7168, 32, "contiguous") == "split"  # 244.7 vs 262.3, uneven 314.4 vs 318.1
    # session 43: swapAB's tiles at gate_up 8 x 32 are the register-capped ones (uneven 75.2 / 75.9 us against the
    # shipped 91.0 / 84.4), which a direct call (a user's config=None) now runs; the key stays upstream (uniform draw)
    for layout in ("contiguous", "masked"):
        cfg = gg.choose_config("swapab", 32, 4096, 7168, 8, "NVIDIA H200", layout=layout)
        assert (cfg["BLOCK_N"], cfg["BLOCK_T"], cfg["num_stages"], cfg["maxnreg"]) == (128, 32, 3, 160), cfg
        assert tc(32, 4096, 7168, 8, layout) == "upstream"
    # split wins the uniform draw (126.6 vs 129.4) but loses the uneven one (135.4 vs 134.9): upstream
    assert tc(24, 4096, 7168, 16, "contiguous") == "upstream"


def test_table_dir_found_without_sglang_h20(monkeypatch):
    """sgl_kernel_ext stands alone: where sglang_h20 is not importable, the shipped tables are the checkout's."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang_h20" else real(name, *a))
    alone = gemm_table._table_dir()
    assert alone == Path(REPO, "python", "sglang_h20", "tables").resolve()
    assert (alone / "grouped_gemm_h200.json").is_file() and (alone / "grouped_gemm_h100.json").is_file()


H100_RUNS = [os.path.join(REPO, "benchmark", "results", "swapab", f) for f in (
    "grouped_gemm_g16_dense_s56_h100.json", "grouped_gemm_g8_32_256_s57_h100.json.xz",
    "grouped_gemm_tune_g16_gate_up_s58_h100.json.xz")]


def test_shipped_h100_table_is_the_measured_run(monkeypatch):
    """The H100's table is three runs' points, merged with `--table-from` (a later run's point replaces an earlier
    one's): session 56's 16 experts x 1-256 tokens (dsv3-ep16-slice's shape) with the dense linears and session 57's
    8, 32 and 256 experts x 1-64 tokens (256: dsv3-4l's), both with the shipped configs, then session 58's tune of
    ours-swapab at gate_up, 16 experts, 1-16 tokens (every upstream provider timed again beside it)."""
    monkeypatch.delenv("SGLANG_H20_GEMM_TABLE")
    gpu = "NVIDIA H100 80GB HBM3"
    table, runs = gemm_table.load_table(gpu), [read_json(p, "shipped run") for p in H100_RUNS]
    assert table["gpu"] == gpu and {r["provenance"]["gpu"] for r in runs} == {gpu} and table["measured"] is True
    assert table["date"] == max(r["provenance"]["date"] for r in runs)
    assert table["source"]["benchmark_command"] == runs[0]["provenance"]["command"]
    assert [m["provenance"] for m in table["source"]["merged_from"]] == [r["provenance"] for r in runs]
    shipped = shipped_table_file(gpu)
    rebuilt_file = rebuilt_table_file(H100_RUNS, shipped, monkeypatch)
    rebuilt = rebuilt_file["entries"]
    assert table["entries"] == rebuilt and len(rebuilt) == 181
    assert rebuilt_file == shipped
    assert {e["groups"] for e in rebuilt if e["layout"] != "dense"} == {8, 16, 32, 256}
    dc = lambda m, n, k, against: gemm_table.table_choice(m, n, k, 1, "dense", gpu, against).best  # noqa: E731
    assert dc(1, 2112, 7168, None) == "swapab"  # q_a+kv_a: 14.9 us vs DeepGEMM 18.5, Triton 40.4
    assert dc(8, 7168, 16384, None) == "upstream"  # o_proj: DeepGEMM is faster than ours ...
    assert dc(8, 7168, 16384, "sglang-triton") != "upstream"  # ... Triton's GEMM slower than ours
    tc = lambda m, n, k, g, layout, against=None: gemm_table.table_choice(  # noqa: E731
        m, n, k, g, layout, gpu, against).best
    # gate_up at 16 experts, tuned on the H100 (session 58): ours swapab 171.2 us vs Triton 174.7 at 1 token, but
    # 112.5 vs 105.6 on the uneven draw, so upstream; at 2 and 4 tokens ours on both draws, contiguous only
    assert tc(1, 4096, 7168, 16, "contiguous") == "upstream"
    assert tc(2, 4096, 7168, 16, "contiguous") == "swapab" == tc(4, 4096, 7168, 16, "contiguous")
    assert tc(2, 4096, 7168, 16, "masked") == "upstream"  # DeepGEMM masked 170.3 vs 171.3
    assert tc(2, 7168, 2048, 16, "contiguous") == "swapab"  # down: 96.3 vs 96.6, uneven 72.5 vs 73.6
    assert tc(1, 7168, 2048, 16, "masked") == "upstream"  # DeepGEMM masked 94.6 vs 95.3
    # session 57's groups: the H100 streams the weights for every provider, so most picks are a tie kept upstream
    assert tc(1, 7168, 2048, 32, "masked") == "swapab"  # 172.5 us vs DeepGEMM 174.8
    assert tc(64, 4096, 7168, 32, "contiguous") == "normal"  # 363.7 us vs Triton 371.2
    assert tc(4, 7168, 2048, 256, "masked") == "swapab"  # 1296.5 us vs DeepGEMM 1309.8
    assert tc(1, 4096, 7168, 256, "contiguous") == "upstream"


def test_table_entries_rules():
    def pt(provider, us, layout="masked", dist="uniform", m=8):
        return {"kind": "moe", "provider": provider, "us": us, "n": 1, "k": 128, "groups": 2,
                "tokens_per_group": m, "layout": layout, "distribution": dist,
                "config": {"BLOCK_N": 64, "BLOCK_T": 16, "rel_err": 0}}
    points = [pt("ours-swapab", 10), pt("ours-normal", 12), pt("deepgemm", 11), pt("sglang-triton", 9, "contiguous"),
              pt("ours-swapab", 10, "contiguous"), pt("ours-swapab", 10, dist="uneven"), pt("deepgemm", 9, dist="uneven"),
              pt("ours-swapab", 5, m=1), pt("deepgemm", 5, m=1), pt("ours-swapab", 5, m=2)]
    entries = {(e["layout"], e["m"]): e for e in gemm_table.table_entries(points)}
    assert entries["contiguous", 8]["best"] == "upstream"  # 9 < 10
    masked = entries["masked", 8]
    assert masked["best"] == "upstream" and masked["us"] == {"swapab": 10, "normal": 12, "upstream": 11}
    assert masked["us_uneven"] == {"swapab": 10, "upstream": 9} and masked["config"]["swapab"] == {"BLOCK_N": 64, "BLOCK_T": 16}
    assert entries["masked", 1]["best"] == "upstream"  # tie
    assert ("masked", 2) not in entries  # no upstream time, no claim


def test_table_entries_take_the_split_variant_with_its_boundary():
    """ours-split competes like the other variants; its config is the boundary judged on both draws together."""
    def pt(provider, us, dist, trials=None, config=None):
        return {"kind": "moe", "provider": provider, "us": us, "n": 1, "k": 128, "groups": 2, "tokens_per_group": 24,
                "layout": "masked", "distribution": dist, "config": config, "trials": trials}

    def split(dist, t16, t32):
        trials = [{"config": {"split_at": t}, "us": us, "tiles": {"split_at": t}} for t, us in ((16, t16), (32, t32))]
        best = min(trials, key=lambda x: x["us"])
        return pt("ours-split", best["us"], dist, trials, best["config"])

    # 16: 10 + 14 = 24, 32: 9 + 16 = 25 -> 16, faster than swapAB and DeepGEMM on both draws
    points = [split("uniform", 10, 9), split("uneven", 14, 16), pt("ours-swapab", 10.5, "uniform"),
              pt("ours-swapab", 18, "uneven"), pt("deepgemm", 10.2, "uniform"), pt("deepgemm", 15, "uneven")]
    [e] = gemm_table.table_entries(points)
    assert e["best"] == "split" and e["config"]["split"] == {"split_at": 16}
    assert e["us"]["split"] == 10 and e["us_uneven"]["split"] == 14
    assert gemm_table.entry_best(e, "deepgemm") == "split"
    [e] = gemm_table.table_entries(points[:-1] + [pt("deepgemm", 13.9, "uneven")])  # upstream wins the uneven draw
    assert e["best"] == "upstream"


def test_a_variant_of_ours_that_wins_both_draws_is_picked_when_the_uniform_fastest_loses_the_uneven_one():
    """Session 53's down 16x64 contiguous: split fastest on the uniform draw but slower than upstream on the uneven
    one, normal faster than upstream on both: normal, not upstream; upstream only when no variant wins both."""
    both = {"split": 77.4, "normal": 77.5, "swapab": 90.0, "upstream": 82.5}
    uneven = {"split": 89.2, "normal": 87.1, "swapab": 95.0, "upstream": 88.7}
    assert gemm_table._fastest(both, uneven) == "normal"
    assert gemm_table._fastest(both, {**uneven, "normal": 88.7}) == "upstream"  # a tie on the uneven draw is upstream's
    assert gemm_table._fastest(both, None) == "split"  # no uneven draw: the uniform draw's fastest
    assert gemm_table._fastest({**both, "normal": 82.5}, uneven) == "upstream"  # a uniform tie is upstream's too
    e = {"best": "upstream", "us": {"split": 77.4, "normal": 77.5}, "us_uneven": uneven,
         "upstream_us_by_provider": {"deepgemm": 82.5, "sglang-triton": 95.0}}
    assert gemm_table.entry_best(e, "deepgemm") == "normal" and gemm_table.entry_best(e, "sglang-triton") == "normal"


def test_table_entries_judge_a_tuned_variant_by_one_config_on_both_draws():
    """Config A is fastest on the uniform draw, B on the uneven one; the table ships one config per key, so it
    takes the one with the least summed time (B) and weighs B's own times against upstream on each draw."""
    a, b = {"BLOCK_N": 64, "programs_per_sm": 4}, {"BLOCK_N": 128, "programs_per_sm": 3}
    tiles = lambda cfg: {"BLOCK_N": cfg["BLOCK_N"], "BLOCK_T": 16, "programs_per_sm": cfg["programs_per_sm"]}  # noqa: E731

    def ours(dist, ta, tb, bad=None):
        trials = [{"config": a, "us": ta, "tiles": tiles(a)}, {"config": b, "us": tb, "tiles": tiles(b)}]
        for t in trials:
            if t["config"] is bad:
                t["rejected_rel_err"] = 0.5
        fastest = min((t for t in trials if "rejected_rel_err" not in t), key=lambda t: t["us"])
        return {"kind": "moe", "provider": "ours-swapab", "us": fastest["us"], "n": 1, "k": 128, "groups": 2,
                "tokens_per_group": 8, "layout": "masked", "distribution": dist, "config": fastest["tiles"],
                "trials": trials}

    def up(dist, us):
        return {"kind": "moe", "provider": "deepgemm", "us": us, "n": 1, "k": 128, "groups": 2,
                "tokens_per_group": 8, "layout": "masked", "distribution": dist}

    # A: 10 + 20 = 30, B: 10.5 + 12 = 22.5 -> B, which loses the uniform draw to upstream's 10.2
    [e] = gemm_table.table_entries([ours("uniform", 10, 10.5), ours("uneven", 20, 12), up("uniform", 10.2),
                                    up("uneven", 13)])
    assert e["us"]["swapab"] == 10.5 and e["us_uneven"]["swapab"] == 12 and e["config"]["swapab"] == tiles(b)
    assert e["best"] == "upstream"
    # each draw's own fastest would have claimed a win on both (10 < 10.2, 12 < 13); with upstream at 10.6 B wins
    [e] = gemm_table.table_entries([ours("uniform", 10, 10.5), ours("uneven", 20, 12), up("uniform", 10.6),
                                    up("uneven", 13)])
    assert e["best"] == "swapab" and e["config"]["swapab"] == tiles(b)
    # a config that failed the error check on either draw is never shipped
    [e] = gemm_table.table_entries([ours("uniform", 10, 10.5), ours("uneven", 20, 12, bad=b), up("uniform", 10.6),
                            up("uneven", 25)])
    assert e["config"]["swapab"] == tiles(a) and e["us_uneven"]["swapab"] == 20 and e["best"] == "swapab"
    # runs before session 38 name only the fastest trial's tiles (the point's config): A is known from the uniform
    # point, B from the uneven one, and a config with unknown tiles is not a candidate
    old = [ours("uniform", 10, 10.5), ours("uneven", 20, 12)]
    for p in old:
        for t in p["trials"]:
            del t["tiles"]
    [e] = gemm_table.table_entries(old + [up("uniform", 10.6), up("uneven", 13)])
    assert e["config"]["swapab"] == tiles(b) and e["us"]["swapab"] == 10.5


# ---------------------------------------------------------------------------------------------
# On a GPU (pytest -m gpu): the real shapes, the real upstream, a CUDA graph
# ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_gpu_slice_moe_matches_upstream_and_replays_from_a_cuda_graph(tokens, monkeypatch, tmp_path):
    """dsv3-ep16-slice's MoE (16 experts, H 7168, I 2048, top-8), ours forced on by a table: equals
    upstream's fused_experts within REL_UPSTREAM; a CUDA graph of our sequence (capture fails on any
    host sync) replayed with new inputs and routing equals an eager call."""
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.moe.topk import StandardTopKOutput
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", load_format="dummy"))
    experts, hidden, inter, top_k = 16, 7168, 2048, 8
    entries = [{"n": n, "k": k, "groups": g, "m": m, "layout": "contiguous", "best": "swapab"}
               for n, k in ((2 * inter, hidden), (hidden, inter)) for g in (1, 2, 4, 8, 16)
               for m in (1, 2, 4, 8, 16, 32, 64)]
    use_table(monkeypatch, write_table(tmp_path / "forced.json", entries))
    fm = importlib.import_module(swapab.TRITON_MOE_MODULE)
    g = torch.Generator(device="cuda").manual_seed(tokens)
    w1, w1s = per_block_quant_fp8(torch.randn(experts, 2 * inter, hidden, device="cuda", generator=g) * 0.02)
    w2, w2s = per_block_quant_fp8(torch.randn(experts, hidden, inter, device="cuda", generator=g) * 0.02)

    def inputs():
        x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
        ids = torch.argsort(torch.rand(tokens, experts, device="cuda", generator=g), 1)[:, :top_k].to(torch.int32)
        return x, ids, torch.rand(tokens, top_k, device="cuda", generator=g) + 0.1

    x, ids, w = inputs()
    cfg = MoeRunnerConfig(num_experts=experts, num_local_experts=experts, top_k=top_k, inplace=True,
                          routed_scaling_factor=2.5)
    kw = dict(moe_runner_config=cfg, use_fp8_w8a8=True, w1_scale=w1s, w2_scale=w2s, block_shape=[128, 128])
    ours = hooked(fm)(x.clone(), w1, w2, StandardTopKOutput(w, ids, None), **kw)
    ref = fm.fused_experts(x.clone(), w1, w2, StandardTopKOutput(w, ids, None), **kw)
    assert torch.isfinite(ours).all() and rel(ours, ref) <= REL_UPSTREAM, rel(ours, ref)

    plan = swapab.plan_moe(tokens, top_k, experts, hidden, inter)
    assert plan is not None
    # no TP group in a unit test: allocate the output plainly (a server would take symmetric memory for it)
    monkeypatch.setattr(fm, "is_allocation_symmetric", lambda: False)
    xs, ids_s, ws = x.clone(), ids.clone(), w.clone()

    def run():
        return swapab.moe_forward(plan, xs, w1, w2, ws, ids_s, w1s, w2s, routed_scaling_factor=2.5)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        run()
        with torch.cuda.graph(graph, stream=stream):
            out_graph = run()
    torch.cuda.current_stream().wait_stream(stream)
    x2, ids2, w2_ = inputs()
    xs.copy_(x2), ids_s.copy_(ids2), ws.copy_(w2_)
    graph.replay()
    torch.cuda.synchronize()
    eager = swapab.moe_forward(plan, x2, w1, w2, w2_, ids2, w1s, w2s, routed_scaling_factor=2.5)
    assert rel(out_graph, eager) <= 1e-3
