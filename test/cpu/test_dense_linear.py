"""The dense FP8 linear hook (sglang_h20.dense_linear) against the installed SGLang 0.5.17.

CPU (Triton interpreter), small shapes: M in {1, 3, 5} rows, K = 256 (two 128 scale blocks), N = 192 (a partial
128-row weight block, like q_a/kv_a's 2112). Upstream's per-token-group quant is replaced by the exact torch one in
upstream's module (the interpreter's fp32 -> fp8 conversion drops mantissa carries); our GEMM is then checked
against float64 on the same dequantized operands, relative error <= 1e-2 (the issue's bound; bf16 output rounding
is ~4e-3), and against upstream's own Triton GEMM on the same quantized operands (<= 1e-2).
"""
import importlib
import inspect
import json
import logging

import torch
# test/conftest.py sets TRITON_INTERPRET=1 before any kernel module is imported when there is no GPU.

import pytest  # noqa: E402

from sgl_kernel_ext.quant import dequant_per_block, dequant_per_token_group, per_block_quant_fp8  # noqa: E402
from sgl_kernel_ext.quant import per_token_group_quant_fp8 as exact_quant  # noqa: E402
from sglang_h20 import dense_linear  # noqa: E402
from sglang_h20.moe import swapab  # noqa: E402
from sglang_h20.settings import Settings  # noqa: E402

N, K = 192, 256
REL = 1e-2


def write_table(path, best="swapab", ms=(1, 2, 4, 8), n=N, k=K, config=None):
    entries = [{"n": n, "k": k, "groups": 1, "m": m, "layout": "dense", "best": best,
                "config": {best: config} if config else {}} for m in ms]
    path.write_text(json.dumps({"gpu": "test", "measured": False, "date": "test", "entries": entries}))
    return path


@pytest.fixture
def table(monkeypatch, tmp_path):
    def use(**kw):
        monkeypatch.setenv("SGLANG_H20_GEMM_TABLE", str(write_table(tmp_path / "t.json", **kw)))
        swapab.reset()
    return use


@pytest.fixture
def exact_upstream_quant(monkeypatch):
    """Upstream's quant module with the exact torch quant (returns [M, K/128] row-major scales, as upstream's)."""
    mod = importlib.import_module(dense_linear.QUANT_MODULE)

    def quant(x, group_size, eps=1e-10, column_major_scales=False, **_):
        assert not column_major_scales
        return exact_quant(x, group_size)

    monkeypatch.setattr(mod, "per_token_group_quant_fp8", quant)
    return quant


def make(seed, m):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, K, generator=g) * 2).to(torch.bfloat16)
    w, w_s = per_block_quant_fp8(torch.randn(N, K, generator=g) * 0.05)
    return x, w, w_s


def recording_original(calls):
    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "upstream"
    return original


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_hook_targets_resolve_and_take_upstreams_parameters():
    from hook_checks import assert_hook_takes_upstreams_parameters

    for target, hook in ((dense_linear.TRITON_LINEAR, dense_linear.triton_linear_hook),
                         (dense_linear.DEEPGEMM_LINEAR, dense_linear.deepgemm_linear_hook)):
        assert_hook_takes_upstreams_parameters(target, hook)
    # upstream's dispatcher looks the backends up by these names when a layer is built
    src = inspect.getsource(importlib.import_module(dense_linear.FP8_UTILS)._dispatch_explicit_backend)
    assert "return triton_w8a8_block_fp8_linear" in src
    assert "return deepgemm_w8a8_block_fp8_linear_with_fallback" in src


def test_swapab_hooks_include_both_linears(table):
    table()
    targets = [h.target for h in swapab.hooks(Settings.from_env({}))]
    assert dense_linear.TRITON_LINEAR in targets and dense_linear.DEEPGEMM_LINEAR in targets


@pytest.mark.parametrize("m,three_d", [(1, False), (3, False), (5, True)], ids=["m1", "m3", "batched-3d"])
def test_ours_where_the_table_says_matches_float64(m, three_d, table, exact_upstream_quant):
    table(config={"BLOCK_N": 64, "split_k": 2})  # two k-slices: the reduce path too
    x, w, w_s = make(m, m)
    inp = x.view(1, m, K) if three_d else x
    calls = []
    out = dense_linear.triton_linear_hook(recording_original(calls), inp, w, [128, 128], w_s)
    assert calls == [] and out.dtype == torch.bfloat16 and out.shape == (*inp.shape[:-1], N)
    q, s = exact_quant(x, 128)
    ref = dequant_per_token_group(q, s).double() @ dequant_per_block(w, w_s).double().T
    assert torch.isfinite(out).all()
    assert rel(out.reshape(m, N), ref) <= REL


def test_ours_matches_upstreams_triton_gemm(table, exact_upstream_quant, monkeypatch):
    """The same quantized operands through upstream's w8a8_block_fp8_matmul_triton (its default tiles: the config
    lookup is given a device name without config files, which a CPU lacks)."""
    from interpreter_compat import allow_scalar_index

    fk = importlib.import_module(dense_linear.QUANT_MODULE)
    monkeypatch.setattr(fk, "get_device_name", lambda *a, **k: "no config files")
    allow_scalar_index(monkeypatch)
    table()
    x, w, w_s = make(11, 4)
    ours = dense_linear.triton_linear_hook(recording_original([]), x, w, [128, 128], w_s)
    q, s = exact_quant(x, 128)
    up = fk.w8a8_block_fp8_matmul_triton(q, w, s, w_s, [128, 128], output_dtype=torch.bfloat16)
    assert rel(ours, up.float()) <= REL


def test_falls_back_unchanged_and_logs_each_reason_once(table, caplog):
    caplog.set_level(logging.INFO, logger="sglang_h20.dense_linear")
    table()
    x, w, w_s = make(3, 2)
    bias = torch.zeros(N, dtype=torch.bfloat16)
    packed = torch.zeros(N, K // 128 // 4, dtype=torch.int32)  # UE8M0-packed scales
    cases = [dict(args=(x, w, [128, 128], w_s), kw=dict(bias=bias)),
             dict(args=(x, w, [128, 128], w_s), kw=dict(input_scale=torch.ones(2, 2))),
             dict(args=(x, w, [128, 128], packed), kw={}),
             dict(args=(x, w, [128, 128], w_s[:, :1].contiguous()), kw={}),  # fp32, per output block only
             dict(args=(x, w, [128, 128], w_s.to(torch.bfloat16)), kw={}),  # the right shape in bf16
             dict(args=(x, w, [64, 64], w_s), kw={}),
             dict(args=(x.float(), w, [128, 128], w_s), kw={}),
             dict(args=(x, w, [128, 128], w_s), kw=dict(bias=bias))]  # the first reason again: not re-logged
    for case in cases:
        calls = []
        assert dense_linear.triton_linear_hook(recording_original(calls), *case["args"], **case["kw"]) == "upstream"
        (args, kw), = calls
        assert all(a is b for a, b in zip(args, case["args"]))
        assert kw == {} and args[4:] == (case["kw"].get("input_scale"), case["kw"].get("bias"))
    assert len(caplog.records) == 7


def test_unsupported_at_the_shape_edges():
    """K must be a multiple of 128 and match the input; the weight scales have ceil(N / 128) rows. N = 129 is the
    smallest N whose partial block is one row: a 129-row weight needs 2 scale rows, not 1."""
    x, w, w_s = make(6, 2)
    assert dense_linear.unsupported(x, w, [128, 128], w_s, None, None) is None
    assert "K=256" in dense_linear.unsupported(x[:, :128].contiguous(), w, [128, 128], w_s, None, None)
    w192 = w[:, :192].contiguous()
    assert "K=192" in dense_linear.unsupported(x[:, :192].contiguous(), w192, [128, 128], w_s[:, :2], None, None)
    w129, s129 = w[:129].contiguous(), w_s[:2].contiguous()
    assert dense_linear.unsupported(x, w129, [128, 128], s129, None, None) is None
    assert "(1, 2)" in dense_linear.unsupported(x, w129, [128, 128], s129[:1].contiguous(), None, None)


def test_upstream_where_the_table_says_or_has_no_dense_entry(table):
    x, w, w_s = make(4, 2)
    for kw in (dict(best="upstream"), dict(n=2 * N), dict(ms=(64, 128))):  # measured upstream / other N / m far
        table(**kw)
        calls = []
        assert dense_linear.triton_linear_hook(recording_original(calls), x, w, [128, 128], w_s) == "upstream"
        assert len(calls) == 1
    table()
    calls = []
    empty = torch.empty(0, K, dtype=torch.bfloat16)
    assert dense_linear.triton_linear_hook(recording_original(calls), empty, w, [128, 128], w_s) == "upstream"


def test_each_backend_hook_weighs_ours_against_the_kernel_it_replaces(monkeypatch, tmp_path, caplog):
    """DeepGEMM fastest (8 us), ours 10, SGLang's Triton GEMM 20: the triton backend's hook runs ours, the deep_gemm
    backend's keeps DeepGEMM; an entry without the provider's time falls back to its overall "best". A pick of ours
    is logged at INFO (what swapab_e2e counts from a server log), one of upstream at DEBUG."""
    caplog.set_level(logging.DEBUG, logger="sglang_h20.dense_linear")
    entry = {"n": N, "k": K, "groups": 1, "layout": "dense", "best": "upstream", "us": {"swapab": 10, "upstream": 8},
             "upstream_us_by_provider": {"deepgemm": 8, "sglang-triton": 20}}
    tables = {"both": [{**entry, "m": m} for m in (1, 2, 4)],
              "no triton time": [{**entry, "m": m, "upstream_us_by_provider": {"deepgemm": 8}} for m in (1, 2, 4)]}
    x, w, w_s = make(5, 2)
    for name, entries in tables.items():
        path = tmp_path / "t.json"
        path.write_text(json.dumps({"gpu": "test", "entries": entries}))
        monkeypatch.setenv("SGLANG_H20_GEMM_TABLE", str(path))
        swapab.reset()
        for hook, ours in ((dense_linear.triton_linear_hook, name == "both"), (dense_linear.deepgemm_linear_hook, False)):
            calls = []
            out = hook(recording_original(calls), x, w, [128, 128], w_s)
            assert (len(calls) == 0) == ours and (out == "upstream") != ours, (name, hook.__name__)
    picks = [(r.levelno, "-> ours" in r.getMessage()) for r in caplog.records if "dense linear M=" in r.getMessage()]
    assert sorted(set(picks)) == [(logging.DEBUG, False), (logging.INFO, True)]
    t = {"entries": [entry, {**entry, "us": {"swapab": 30}}, {"layout": "masked", "best": "swapab"}]}
    assert dense_linear.dense_entries(t) == (2, {"sglang-triton": 1, "deepgemm": 0})


def test_table_entries_from_dense_points_keep_the_k_slices():
    from sgl_kernel_ext import gemm_table

    def pt(provider, us, m=8, split_k=4):
        return {"kind": "dense", "provider": provider, "us": us, "n": 2112, "k": 7168, "groups": 1,
                "tokens_per_group": m, "layout": "dense", "distribution": "dense",
                "config": {"BLOCK_N": 64, "BLOCK_T": 16, "split_k": split_k, "num_stages": 4}}
    points = [pt("ours-swapab", 10), pt("ours-normal", 14), pt("sglang-triton", 20), pt("deepgemm", 12),
              pt("ours-swapab", 9, m=64), pt("deepgemm", 8, m=64)]
    entries = {e["m"]: e for e in gemm_table.table_entries(points)}
    assert entries[8]["layout"] == "dense" and entries[8]["best"] == "swapab" and entries[8]["us"]["upstream"] == 12
    assert entries[8]["config"]["swapab"]["split_k"] == 4 and entries[8]["upstream_us_by_provider"] == {
        "sglang-triton": 20, "deepgemm": 12}
    assert entries[64]["best"] == "upstream"


def test_sm_budget_reaches_our_gemm_and_ends_with_its_block(table, exact_upstream_quant, monkeypatch):
    """Inside sm_budget(n) our GEMM gets num_sms=n (the shared expert beside the routed ones), outside it none; the
    result is the same GEMM's."""
    from sgl_kernel_ext import grouped_gemm_fp8 as gg

    table(config={"BLOCK_N": 64, "split_k": 2})
    seen, configs, gemm = [], [], gg.fp8_gemm_nt
    monkeypatch.setattr(gg, "fp8_gemm_nt", lambda *a, **kw: seen.append(kw.get("num_sms")) or
                        configs.append(kw.get("config")) or gemm(*a, **kw))
    x, w, w_s = make(5, 3)
    free = dense_linear.triton_linear_hook(recording_original([]), x, w, [128, 128], w_s)
    with dense_linear.sm_budget(1):
        capped = dense_linear.triton_linear_hook(recording_original([]), x, w, [128, 128], w_s)
    after = dense_linear.triton_linear_hook(recording_original([]), x, w, [128, 128], w_s)
    assert seen == [None, 1, None]
    assert configs[0] == configs[2] == {"BLOCK_N": 64, "split_k": 2}  # the table's
    assert configs[1] == {"BLOCK_N": 64, "split_k": 2, "num_stages": 3, "programs_per_sm": 1}  # slimmed to fit beside
    assert torch.equal(capped, free) and torch.equal(after, free)  # same k-slices: the same bits on fewer programs
    assert dense_linear.beside_config({"num_stages": 6, "programs_per_sm": 2, "split_k": 7}) == \
        {"num_stages": 3, "programs_per_sm": 1, "split_k": 7}
    assert dense_linear.beside_config({"num_stages": 2})["num_stages"] == 2  # never deeper than asked


def test_a_tabled_split_k_is_what_fp8_gemm_nt_runs():
    from sgl_kernel_ext import grouped_gemm_fp8 as gg

    assert gg.plan_fp8_gemm_nt(4, 2112, 7168, "swapab", config={"split_k": 7})[2] == 7
    assert gg.plan_fp8_gemm_nt(4, 2112, 7168, "swapab", config={"split_k": 7}, split_k=2)[2] == 2  # the argument wins
    assert gg.plan_fp8_gemm_nt(4, 2112, 7168, "swapab")[2] == gg._pick_split_k(33, 56, 264)  # automatic otherwise


# ---------------------------------------------------------------------------------------------
# On a GPU (pytest -m gpu): DeepSeek-V3's dense linears, upstream's real Triton linear, a CUDA graph
# ---------------------------------------------------------------------------------------------
DSV3_LINEARS = {"qkv_a": (2112, 7168), "q_b": (24576, 1536), "o_proj": (7168, 16384),
                "shared_gate_up": (4096, 7168), "shared_down": (7168, 2048)}


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 37, 128])
@pytest.mark.parametrize("name", sorted(DSV3_LINEARS))
def test_gpu_dsv3_linears_match_upstream_and_replay_from_a_cuda_graph(name, m, monkeypatch, tmp_path):
    """Ours forced on by a table (swapab below 64 rows, normal above, the automatic k-slices): within 1e-2 of
    float64 on the dequantized operands and of upstream's triton_w8a8_block_fp8_linear; finite; a CUDA graph of
    the hooked call replayed on new rows equals an eager call (capture fails on any host sync)."""
    n, k = DSV3_LINEARS[name]
    variant = "swapab" if m <= 64 else "normal"
    monkeypatch.setenv("SGLANG_H20_GEMM_TABLE", str(write_table(tmp_path / "t.json", best=variant, n=n, k=k,
                                                                ms=(1, 2, 4, 8, 16, 32, 64, 128, 256))))
    swapab.reset()
    fu = importlib.import_module(dense_linear.FP8_UTILS)
    g = torch.Generator(device="cuda").manual_seed(m)
    w, w_s = per_block_quant_fp8(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    x = (torch.randn(m, k, device="cuda", generator=g) * 3).to(torch.bfloat16)
    calls = []
    ours = dense_linear.triton_linear_hook(recording_original(calls), x, w, [128, 128], w_s)
    assert calls == [] and torch.isfinite(ours).all()
    q, s = exact_quant(x.float(), 128)
    ref = dequant_per_token_group(q, s).double() @ dequant_per_block(w, w_s).double().T
    assert rel(ours, ref) <= REL, rel(ours, ref)
    up = fu.triton_w8a8_block_fp8_linear(x, w, [128, 128], w_s)
    assert rel(ours, up.float()) <= REL, rel(ours, up.float())

    xs = x.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        dense_linear.triton_linear_hook(recording_original(calls), xs, w, [128, 128], w_s)
        with torch.cuda.graph(graph, stream=stream):
            out_graph = dense_linear.triton_linear_hook(recording_original(calls), xs, w, [128, 128], w_s)
    torch.cuda.current_stream().wait_stream(stream)
    xs.copy_((torch.randn(m, k, device="cuda", generator=g) * 3).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    eager = dense_linear.triton_linear_hook(recording_original(calls), xs, w, [128, 128], w_s)
    assert calls == [] and rel(out_graph, eager.float()) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["shared_gate_up", "shared_down"])
def test_gpu_shared_expert_linears_on_an_sm_budget(name, monkeypatch, tmp_path):
    """The shared expert's linears inside sm_budget (SGLANG_H20_SBO_SHARED_SMS), eager and captured beside a busy
    stream: bit-equal to the full grid with the same k-slices, within 1e-2 of float64, at 16 and 32 rows."""
    n, k = DSV3_LINEARS[name]
    monkeypatch.setenv("SGLANG_H20_GEMM_TABLE", str(write_table(tmp_path / "t.json", n=n, k=k, ms=(16, 32),
                                                                config={"split_k": 2})))
    swapab.reset()
    g = torch.Generator(device="cuda").manual_seed(7)
    w, w_s = per_block_quant_fp8(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    for m in (16, 32):
        x = (torch.randn(m, k, device="cuda", generator=g) * 3).to(torch.bfloat16)
        full = dense_linear.triton_linear_hook(recording_original([]), x, w, [128, 128], w_s)
        q, s = exact_quant(x.float(), 128)
        ref = dequant_per_token_group(q, s).double() @ dequant_per_block(w, w_s).double().T
        for sms in (1, 16, 32):
            with dense_linear.sm_budget(sms):
                capped = dense_linear.triton_linear_hook(recording_original([]), x, w, [128, 128], w_s)
            assert torch.equal(capped, full), (m, sms)
        assert rel(full, ref) <= REL
        side, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), dense_linear.sm_budget(16):
            dense_linear.triton_linear_hook(recording_original([]), x, w, [128, 128], w_s)
            with torch.cuda.graph(graph, stream=side):
                out = dense_linear.triton_linear_hook(recording_original([]), x, w, [128, 128], w_s)
        busy = torch.randn(4096, 4096, device="cuda", generator=g)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            graph.replay()
        busy @ busy  # the main stream busy while the replay runs on the side stream
        torch.cuda.synchronize()
        assert torch.equal(out, full), m
