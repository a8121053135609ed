"""FP8 block-scaled grouped GEMMs (swapAB and normal), the dense GEMM, and the FP8 quant kernels, on CPU.

Without a GPU the Triton kernels run under TRITON_INTERPRET=1 (set here, and the kernel modules
re-imported if something imported them compiled first), with tiny shapes. Every output is poisoned with NaN first; every valid element must be finite and match the
float32 reference on the dequantized inputs (per group: ||out - ref|| / ||ref|| <= 1e-2 and
max |out - ref| <= 1e-2 * max |ref|); every element outside the groups must still be NaN.
Inputs are fresh random values with per-row / per-block magnitudes that differ (so a scale applied
to the wrong row or block shows), never zeros.

Interpreter notes: it truncates fp32 -> bf16 (no rounding), so the measured error here (~3e-3) is
about 4x what a GPU's round-to-nearest gives; quant.py pre-rounds to the fp8 grid under the
interpreter because its fp32 -> fp8 conversion drops the mantissa carry.
"""
import itertools
import json

import torch

# test/conftest.py sets TRITON_INTERPRET=1 before any kernel module is imported when there is no GPU.

import pytest  # noqa: E402

from sgl_kernel_ext import gemm_table  # noqa: E402
from sgl_kernel_ext import grouped_gemm_fp8 as gg  # noqa: E402
from sgl_kernel_ext.quant import (  # noqa: E402
    FP8_MAX, dequant_per_block, dequant_per_token_group, per_block_quant_fp8, per_token_group_quant_fp8,
    silu_mul_quant_fp8, silu_mul_quant_fp8_reference,
)

REL = 1e-2
# e4m3 round-to-nearest: |q - v| <= half an ulp; the top binade [256, 448] has ulp 32, so the error
# of a dequantized value is at most 16 * scale = amax * 16 / 448 of its group.
QUANT_BOUND = 16.0 / FP8_MAX

SWAPAB_CONFIGS = [None, {"BLOCK_N": 64, "BLOCK_T": 16}, {"BLOCK_N": 128, "BLOCK_T": 32},
                  {"BLOCK_N": 64, "BLOCK_T": 16, "flat": True},  # flat: the flattened persistent walk
                  {"BLOCK_N": 64, "BLOCK_T": 16, "flat": True, "tma": True},  # + operands by TMA descriptors
                  {"BLOCK_N": 256, "BLOCK_T": 64, "num_warps": 8},  # weights on two warpgroups, per-row scales
                  {"BLOCK_N": 64, "BLOCK_T": 32, "programs_per_sm": 4}]  # more programs than tiles at small shapes
NORMAL_CONFIGS = [None, {"BLOCK_N": 256, "BLOCK_T": 64},  # 256: the per-column weight-scale path
                  {"BLOCK_N": 256, "BLOCK_T": 64, "flat": True},
                  {"BLOCK_N": 256, "BLOCK_T": 64, "flat": True, "tma": True},
                  {"BLOCK_N": 64, "BLOCK_T": 64, "programs_per_sm": 3},  # half a weight-scale block per tile
                  {"BLOCK_N": 64, "BLOCK_T": 64, "programs_per_sm": 3, "flat": True, "tma": True}]
CASES = [("swapab", c) for c in SWAPAB_CONFIGS] + [("normal", c) for c in NORMAL_CONFIGS]
CASE_IDS = [f"{v}-{c['BLOCK_N']}x{c['BLOCK_T']}{'-flat' if c.get('flat') else ''}{'-tma' if c.get('tma') else ''}"
            if c else f"{v}-default" for v, c in CASES]


pytestmark = pytest.mark.usefixtures("no_gemm_table")


def gen(seed):
    return torch.Generator().manual_seed(seed)


def activations(shape, seed):
    """Random activations, quantized per 1x128 group; row magnitudes spread over ~e^±2."""
    g = gen(seed)
    x = torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g))
    return per_token_group_quant_fp8(x)


def weights(groups, n, k, seed):
    g = gen(seed)
    w = torch.randn(groups, n, k, generator=g) * 0.05
    w = w * torch.exp(torch.randn(groups, 1, k, generator=g))  # per-column magnitudes differ
    return per_block_quant_fp8(w)


def poisoned(*shape):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16)


def check_rows(out, ref, what):
    """out: bf16 rows of one group, ref: fp32; returns (normwise, max-abs relative) errors."""
    o = out.float()
    assert torch.isfinite(o).all(), f"{what}: NaN/Inf in valid rows (unwritten or bad math)"
    norm_err = ((o - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    max_err = ((o - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    assert norm_err <= REL, f"{what}: ||out-ref||/||ref|| = {norm_err:.3e}"
    assert max_err <= REL, f"{what}: max|out-ref|/max|ref| = {max_err:.3e}"
    return norm_err, max_err


def cumsum0(ms, start=0):
    return torch.tensor([start] + [start + s for s in itertools.accumulate(ms)], dtype=torch.int32)


class GroupedCall:
    """One layout's grouped GEMM over per-group counts, for the tests that compare walks and variants bit for bit:
    run(variant, config) -> a fresh NaN-poisoned output written by one call; rows(out, g) -> group g's rows; ref()
    -> float32. Contiguous: a spare row before and after the groups. Masked: A holds `max_m` rows per group and the
    rows past each count are e4m3 NaN (0x7f), which boxes may read and which must never reach a written row."""

    def __init__(self, layout, counts, b, b_s, seed, max_m=None):
        self.layout, self.counts, self.b, self.b_s = layout, list(counts), b, b_s
        groups, self.n, k = b.shape
        if layout == "contiguous":
            self.a, self.a_s = activations((sum(counts) + 2, k), seed=seed)
            self.ip = cumsum0(counts, start=1)
        else:
            self.a, self.a_s = activations((groups, max_m or max(counts), k), seed=seed)
            self.mm = torch.tensor(counts, dtype=torch.int32)
            for gi, m in enumerate(counts):
                self.a.view(torch.uint8)[gi, m:] = 0x7F

    def run(self, variant, config):
        if self.layout == "contiguous":
            return gg.m_grouped_fp8_gemm_nt_contiguous(self.a, self.a_s, self.b, self.b_s, self.ip,
                                                       out=poisoned(self.a.shape[0], self.n), variant=variant,
                                                       config=config)
        return gg.m_grouped_fp8_gemm_nt_masked(self.a, self.a_s, self.b, self.b_s, self.mm,
                                               out=poisoned(*self.a.shape[:2], self.n), variant=variant, config=config)

    def rows(self, out, g):
        return out[self.ip[g]:self.ip[g + 1]] if self.layout == "contiguous" else out[g, :self.counts[g]]

    def ref(self):
        if self.layout == "contiguous":
            return gg.grouped_gemm_reference(self.a, self.a_s, self.b, self.b_s, m_indptr=self.ip)
        return gg.grouped_gemm_reference(torch.nan_to_num(self.a.float()).to(self.a.dtype), self.a_s, self.b,
                                         self.b_s, masked_m=self.mm)


def assert_same_bits(got, want, what):
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: other rows written"
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want)), what


# ---------------------------------------------------------------------------------------------
# Grouped GEMMs
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant,config", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("ms,n,k", [
    ([3, 0, 17, 1, 40], 192, 384),  # N = 1.5 scale blocks, m = 0, m not a multiple of any tile
    ([0, 33, 0, 9], 256, 512),
    ([65, 2], 128, 256),
])
def test_contiguous(variant, config, ms, n, k):
    groups, lead, tail = len(ms), 2, 3  # rows before m_indptr[0] and after m_indptr[G]: not ours
    m_total = lead + sum(ms) + tail
    a, a_s = activations((m_total, k), seed=sum(ms) + n)
    b, b_s = weights(groups, n, k, seed=k)
    ip = cumsum0(ms, start=lead)
    out = poisoned(m_total, n)
    res = gg.m_grouped_fp8_gemm_nt_contiguous(a, a_s, b, b_s, ip, out=out, variant=variant, config=config)
    assert res is out
    ref = gg.grouped_gemm_reference(a, a_s, b, b_s, m_indptr=ip)
    for g in range(groups):
        lo, hi = ip[g].item(), ip[g + 1].item()
        if hi > lo:
            check_rows(out[lo:hi], ref[lo:hi], f"group {g} (m={hi - lo})")
    assert out[:lead].isnan().all() and out[m_total - tail:].isnan().all(), "rows outside the groups written"


def test_contiguous_makes_out_when_none_is_given():
    """out=None: a fresh bf16 [M_total, N], the groups' rows as with a given out."""
    ms, n, k = [5, 0, 11], 128, 256
    a, a_s = activations((1 + sum(ms), k), seed=31)
    b, b_s = weights(len(ms), n, k, seed=32)
    ip = cumsum0(ms, start=1)
    res = gg.m_grouped_fp8_gemm_nt_contiguous(a, a_s, b, b_s, ip, variant="swapab")
    assert res.shape == (1 + sum(ms), n) and res.dtype == torch.bfloat16
    given = poisoned(1 + sum(ms), n)
    gg.m_grouped_fp8_gemm_nt_contiguous(a, a_s, b, b_s, ip, out=given, variant="swapab")
    assert torch.equal(res[1:], given[1:])


@pytest.mark.parametrize("variant,config", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("masked,max_m,n,k", [
    ([0, 24, 5, 17], 24, 192, 256),
    ([1, 0, 0, 40, 70], 72, 128, 512),  # 70 of 72: the last tile is partial
    ([3, 30], 24, 256, 384),  # masked_m > max_m is clamped to max_m
    ([1, 0, 1], 1, 128, 256),  # one row per expert (a one-token decode batch under expert parallelism)
])
def test_masked(variant, config, masked, max_m, n, k):
    groups = len(masked)
    a, a_s = activations((groups, max_m, k), seed=max_m + n)
    b, b_s = weights(groups, n, k, seed=k + 1)
    mm = torch.tensor(masked, dtype=torch.int32)
    out = poisoned(groups, max_m, n)
    gg.m_grouped_fp8_gemm_nt_masked(a, a_s, b, b_s, mm, out=out, variant=variant, config=config)
    ref = gg.grouped_gemm_reference(a, a_s, b, b_s, masked_m=mm)
    for g, m in enumerate(masked):
        m = min(m, max_m)
        if m:
            check_rows(out[g, :m], ref[g, :m], f"group {g} (m={m})")
        assert out[g, m:].isnan().all(), f"group {g}: rows at or past masked_m={m} written"


def test_pick_split_k_worked_values():
    """The smallest divisor of the K-block count whose splits fill the SMs (keeping >= 4 blocks each); when none
    does, the largest that keeps 4; enough tiles already: no split."""
    assert gg._pick_split_k(132, 56, 132) == 1
    assert gg._pick_split_k(33, 56, 132) == 4    # 33 x 4 = 132 exactly fills them
    assert gg._pick_split_k(33, 56, 264) == 8    # 7 gives 231 < 264
    assert gg._pick_split_k(1, 56, 132) == 14    # none fills them: 56 / 14 = 4 blocks each
    assert gg._pick_split_k(1, 3, 132) == 1      # 3 K blocks: no split keeps 4


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_flat_walk_equals_the_group_walk(layout, tma):
    """config flat (one flattened loop over this program's tiles, groups found from running tile counts): the
    same tiles with the same K loop, so the same bits, over empty, small and uneven groups. With tma the boxes
    also read rows past each group's real ones: in the masked layout those rows are NaN here, and the result
    must still be the same bits (each output element depends on its own rows only, and those are masked)."""
    ms = [0, 5, 33, 0, 1, 17, 0, 0, 40]
    b, b_s = weights(len(ms), 192, 256, seed=3)
    call = GroupedCall(layout, ms, b, b_s, seed=4)
    for variant, cfg in (("swapab", {"BLOCK_N": 64, "BLOCK_T": 16}), ("normal", {"BLOCK_N": 128, "BLOCK_T": 64})):
        assert_same_bits(call.run(variant, {**cfg, "flat": True, "tma": tma}), call.run(variant, cfg), variant)


@pytest.mark.parametrize("flat", [False, True], ids=["group-walk", "flat"])
def test_register_cap_reaches_the_compiler_and_changes_no_bit(flat, monkeypatch):
    """config maxnreg is a compile option of the tile kernels (ptxas caps registers per thread; the interpreter
    ignores it): it reaches the launch, and the result is the same bits as without it."""
    ms = [0, 5, 33, 0, 1, 17, 0, 0, 40]
    b, b_s = weights(len(ms), 192, 256, seed=3)
    call = GroupedCall("contiguous", ms, b, b_s, seed=4)
    cfg = {"BLOCK_N": 64, "BLOCK_T": 32, "flat": flat}
    want = call.run("swapab", cfg)
    name = "_fp8_grouped_gemm_flat_kernel" if flat else "_fp8_grouped_gemm_kernel"
    kernel, seen = getattr(gg, name), []

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(kw)
                return kernel[grid](*args, **kw)
            return launch
    monkeypatch.setattr(gg, name, Spy())
    assert_same_bits(call.run("swapab", {**cfg, "maxnreg": 128}), want, "maxnreg")
    assert [kw.get("maxnreg") for kw in seen] == [128] and seen[0]["num_warps"] == 4
    assert "maxnreg" not in gg._compile_options({"num_stages": 4})  # unset: the compiler's own choice


class LaunchCounter:
    """Stands in for a kernel object: counts `kernel[grid](...)` launches, then launches the real one."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_ws_config_equals_the_group_walk(layout, monkeypatch):
    """config ws (a map of the real token tiles, then a persistent walk over them through TMA boxes on the GPU, its
    loop warp-specialized there with ws_split): the same bits as the group walk over empty, small, uneven and full groups and over
    all groups empty; in the masked layout rows past masked_m are NaN in A (read by the boxes, never into a written
    row) and nothing is written at or past masked_m. The ws kernels must be what ran."""
    ms = [0, 5, 33, 0, 1, 17, 0, 40, 40]
    b, b_s = weights(len(ms), 192, 256, seed=8)
    for counts in (ms, [0] * len(ms)):
        call = GroupedCall(layout, counts, b, b_s, seed=9, max_m=40)
        for variant, cfg in (("swapab", {"BLOCK_N": 64, "BLOCK_T": 16}), ("normal", {"BLOCK_N": 128, "BLOCK_T": 32}),
                             ("normal", {"BLOCK_N": 256, "BLOCK_T": 64})):
            spies = {name: LaunchCounter(getattr(gg, name)) for name in ("_token_tile_map_kernel",
                                                                          "_fp8_grouped_gemm_ws_kernel")}
            plain = call.run(variant, cfg)
            with monkeypatch.context() as mp:
                for name, spy in spies.items():
                    mp.setattr(gg, name, spy)
                ws = call.run(variant, {**cfg, "ws": True})
            assert [spy.launches for spy in spies.values()] == [1, 1], (variant, cfg)  # not a fallback
            assert_same_bits(ws, plain, (layout, counts, variant, cfg))
            if layout == "masked":
                for gi, m in enumerate(counts):
                    assert not ws[gi, :m].isnan().any() and ws[gi, m:].isnan().all(), (variant, cfg, gi)


def test_ws_split_runs_only_when_asked_for_by_env(monkeypatch):
    """ws_split (Triton's warp-specialized loop) hung on the H200 in 5 of 6 cases (benchmark/results/swapab/
    probe_ws_walk*_h200.json): a clear error before any launch unless SGLANG_H20_WS_SPLIT=1, not a kernel that never
    returns; with it the call runs (the interpreter ignores the split, so the bits are the group walk's)."""
    a, a_s = activations((2, 16, 256), seed=21)
    b, b_s = weights(2, 128, 256, seed=22)
    mm = torch.tensor([16, 3], dtype=torch.int32)

    def run(cfg):
        return gg.m_grouped_fp8_gemm_nt_masked(a, a_s, b, b_s, mm, out=poisoned(2, 16, 128), variant="swapab",
                                               config={"BLOCK_N": 64, "BLOCK_T": 16, "num_stages": 3, **cfg})

    monkeypatch.delenv("SGLANG_H20_WS_SPLIT", raising=False)
    with pytest.raises(ValueError, match="SGLANG_H20_WS_SPLIT=1"):
        run({"ws": True, "ws_split": True})
    monkeypatch.setenv("SGLANG_H20_WS_SPLIT", "1")
    assert_same_bits(run({"ws": True, "ws_split": True}), run({}), "ws_split")


@pytest.mark.parametrize("walk", [{}, {"flat": True}, {"ws": True}], ids=["group", "flat", "ws"])
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_split_variant_is_swapab_below_the_split_and_normal_above(layout, walk):
    """variant split (two launches, each walking only its groups by count): every group's rows are bit for bit what
    the variant owning its count writes alone (swapAB at m <= split_at, normal above), each group written exactly
    once (a group walked by both launches would still match; one walked by neither stays NaN), nothing outside
    the groups; the boundary count itself (m == split_at) goes to swapAB. Against float32 as well."""
    ms, t = [0, 5, 16, 17, 0, 1, 40, 33], 16
    b, b_s = weights(len(ms), 192, 256, seed=31)
    cfgs = {"swapab": {"BLOCK_N": 64, "BLOCK_T": 16, **walk}, "normal": {"BLOCK_N": 128, "BLOCK_T": 32, **walk}}
    call = GroupedCall(layout, ms, b, b_s, seed=32)
    split = call.run("split", {"split_at": t, **cfgs})
    alone = {v: call.run(v, c) for v, c in cfgs.items()}
    ref = call.ref()
    for gi, m in enumerate(ms):
        owner = alone["swapab" if m <= t else "normal"]
        assert torch.equal(call.rows(split, gi), call.rows(owner, gi)), (gi, m)
        if m:
            check_rows(call.rows(split, gi), call.rows(ref, gi), f"group {gi} (m={m})")
    assert torch.equal(split.isnan(), alone["swapab"].isnan()), "written rows differ from one whole launch's"
    # two streams (the GPU test times and graph-captures them): off the GPU the halves run in turn, same rows
    assert torch.equal(call.run("split", {"split_at": t, "split_streams": 2, **cfgs}).nan_to_num(), split.nan_to_num())


def test_split_variant_refuses_what_it_cannot_split():
    a, a_s = activations((2, 16, 256), seed=34)
    b, b_s = weights(2, 128, 256, seed=35)
    mm = torch.tensor([16, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="split_k 1"):
        gg.m_grouped_fp8_gemm_nt_masked(a, a_s, b, b_s, mm, variant="split", split_k=2)
    with pytest.raises(ValueError, match="split_at"):
        gg.m_grouped_fp8_gemm_nt_masked(a, a_s, b, b_s, mm, variant="split", config={"split_at": 0})


def test_auto_runs_split_where_the_table_says_and_one_launch_elsewhere(monkeypatch, tmp_path):
    """'auto' takes the table's 'split' with its boundary in the masked layout; a caller that needs one launch
    (resolve_config: SBO, the EP combine) gets one variant instead."""
    table = {"gpu": "test", "entries": [{"n": 128, "k": 256, "groups": 2, "m": m, "layout": "masked", "best": "split",
                                         "config": {"split": {"split_at": 8}}} for m in (4, 16)]}
    (tmp_path / "t.json").write_text(json.dumps(table))
    monkeypatch.setenv("SGLANG_H20_GEMM_TABLE", str(tmp_path / "t.json"))
    gemm_table.forget_tables()
    a, a_s = activations((2, 16, 256), seed=36)
    b, b_s = weights(2, 128, 256, seed=37)
    mm = torch.tensor([16, 3], dtype=torch.int32)
    launches = []
    real = gg._launch

    def spy(*args, **kw):
        launches.append((kw["variant"], kw["count_range"]))
        return real(*args, **kw)

    monkeypatch.setattr(gg, "_launch", spy)
    out = gg.m_grouped_fp8_gemm_nt_masked(a, a_s, b, b_s, mm, out=poisoned(2, 16, 128), expected_m=10)
    assert launches == [("swapab", (-1, 8)), ("normal", (8, 1 << 30))]
    ref = gg.grouped_gemm_reference(a, a_s, b, b_s, masked_m=mm)
    for g, m in enumerate(mm.tolist()):
        check_rows(out[g, :m], ref[g, :m], f"group {g}")
    assert gg.resolve_config("auto", None, 10, 128, 256, 2, "masked")[0] == "swapab"
    gemm_table.forget_tables()


@pytest.mark.parametrize("variant", gg.VARIANTS)
def test_all_groups_empty(variant):
    a, a_s = activations((3, 16, 256), seed=5)
    b, b_s = weights(3, 128, 256, seed=6)
    out = poisoned(3, 16, 128)
    gg.m_grouped_fp8_gemm_nt_masked(a, a_s, b, b_s, torch.zeros(3, dtype=torch.int32), out=out, variant=variant)
    assert out.isnan().all()
    a2, a2_s = activations((8, 256), seed=7)
    out2 = poisoned(8, 128)
    gg.m_grouped_fp8_gemm_nt_contiguous(a2, a2_s, b, b_s, torch.full((4,), 3, dtype=torch.int32),
                                        out=out2, variant=variant)
    assert out2.isnan().all()


@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_split_k_grouped(layout):
    """k-slices + the reduce kernel, which must also skip rows outside the groups."""
    n, k = 192, 512
    if layout == "contiguous":
        ms = [4, 0, 19]
        a, a_s = activations((sum(ms) + 2, k), seed=11)
        b, b_s = weights(3, n, k, seed=12)
        ip = cumsum0(ms, start=1)
        out = poisoned(sum(ms) + 2, n)
        gg.m_grouped_fp8_gemm_nt_contiguous(a, a_s, b, b_s, ip, out=out, variant="swapab", split_k=2)
        ref = gg.grouped_gemm_reference(a, a_s, b, b_s, m_indptr=ip)
        check_rows(out[1:-1], ref[1:-1], "split-k contiguous")
        assert out[0].isnan().all() and out[-1].isnan().all()
    else:
        masked = [6, 0, 13]
        a, a_s = activations((3, 16, k), seed=13)
        b, b_s = weights(3, n, k, seed=14)
        mm = torch.tensor(masked, dtype=torch.int32)
        out = poisoned(3, 16, n)
        gg.m_grouped_fp8_gemm_nt_masked(a, a_s, b, b_s, mm, out=out, variant="normal", split_k=4)
        ref = gg.grouped_gemm_reference(a, a_s, b, b_s, masked_m=mm)
        for g, m in enumerate(masked):
            if m:
                check_rows(out[g, :m], ref[g, :m], f"split-k masked group {g}")
            assert out[g, m:].isnan().all()


@pytest.mark.parametrize("m,n,split_k,variant", [
    (1, 192, None, "auto"), (7, 192, 2, "swapab"), (33, 128, 1, "swapab"), (70, 256, None, "normal"),
])
def test_fp8_gemm_nt(m, n, split_k, variant):
    k = 512
    a, a_s = activations((m, k), seed=m)
    w = torch.randn(n, k, generator=gen(n)) * 0.05
    b, b_s = per_block_quant_fp8(w)
    out = poisoned(m, n)
    gg.fp8_gemm_nt(a, a_s, b, b_s, out=out, variant=variant, split_k=split_k)
    ref = gg.grouped_gemm_reference(a, a_s, b, b_s)
    check_rows(out, ref, f"dense m={m}")
    fresh = gg.fp8_gemm_nt(a, a_s, b, b_s, variant=variant, split_k=split_k)
    assert fresh.dtype == torch.bfloat16 and fresh.shape == (m, n)


def test_fp8_gemm_nt_on_fewer_sms(monkeypatch):
    """num_sms caps the persistent grid (the shared expert beside the routed experts): the launch gets the cap,
    the automatic k-slices are picked for it, the bits with a fixed split_k equal the full grid's."""
    m, n, k = 5, 192, 1024
    a, a_s = activations((m, k), seed=41)
    b, b_s = per_block_quant_fp8(torch.randn(n, k, generator=gen(42)) * 0.05)
    seen = []
    launch = gg._launch
    monkeypatch.setattr(gg, "_launch", lambda *args, **kw: seen.append(kw["num_sms"]) or launch(*args, **kw))
    full = gg.fp8_gemm_nt(a, a_s, b, b_s, variant="swapab", split_k=2)
    for cap in (1, 3, 999):
        capped = gg.fp8_gemm_nt(a, a_s, b, b_s, variant="swapab", split_k=2, num_sms=cap)
        assert torch.equal(capped, full), cap
    auto = gg.fp8_gemm_nt(a, a_s, b, b_s, variant="swapab", config={"BLOCK_N": 64}, num_sms=1)
    check_rows(auto, gg.grouped_gemm_reference(a, a_s, b, b_s), "dense on one SM")
    assert seen == [4, 1, 3, 4, 1]  # the interpreter's 4 SMs; a cap above them is no cap
    # 3 output tiles of 64 columns: 4 SMs' worth of programs want k-slices, one SM's do not
    assert gg.plan_fp8_gemm_nt(m, n, k, "swapab", {"BLOCK_N": 64}, num_sms=4)[2] == 2
    assert gg.plan_fp8_gemm_nt(m, n, k, "swapab", {"BLOCK_N": 64}, num_sms=1)[2] == 1


def test_column_major_activation_scales():
    """DeepGEMM keeps activation scales MN-major; strides are honoured."""
    a, a_s = activations((20, 256), seed=21)
    b, b_s = weights(2, 128, 256, seed=22)
    a_s_cm = a_s.t().contiguous().t()
    assert a_s_cm.stride() != a_s.stride()
    ip = torch.tensor([0, 9, 20], dtype=torch.int32)
    out = poisoned(20, 128)
    gg.m_grouped_fp8_gemm_nt_contiguous(a, a_s_cm, b, b_s, ip, out=out, variant="swapab")
    check_rows(out, gg.grouped_gemm_reference(a, a_s, b, b_s, m_indptr=ip), "column-major scales")


def test_rejects_bad_operands():
    a, a_s = activations((4, 256), seed=1)
    b, b_s = weights(2, 128, 256, seed=2)
    ip = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(TypeError):
        gg.m_grouped_fp8_gemm_nt_contiguous(a.float(), a_s, b, b_s, ip)
    with pytest.raises(ValueError):
        gg.m_grouped_fp8_gemm_nt_contiguous(a, a_s[:, :1], b, b_s, ip)
    with pytest.raises(ValueError):
        gg.m_grouped_fp8_gemm_nt_contiguous(a, a_s, b, b_s, ip.long())
    with pytest.raises(ValueError):
        gg.m_grouped_fp8_gemm_nt_contiguous(a, a_s, b, b_s, ip, variant="fast")
    with pytest.raises(ValueError):
        gg.fp8_gemm_nt(a, a_s, b[0], b_s[0], split_k=3)  # K/128 = 2 is not divisible by 3
    with pytest.raises(TypeError, match="scales must be float32"):
        gg.m_grouped_fp8_gemm_nt_contiguous(a, a_s, b, b_s.double(), ip)
    b3, b3_s = weights(2, 128, 384, seed=4)  # K 384 against a's 256, each a multiple of 128
    with pytest.raises(ValueError, match="K must match"):
        gg.m_grouped_fp8_gemm_nt_contiguous(a, a_s, b3, b3_s, ip)
    k200 = torch.zeros(4, 200).to(torch.float8_e4m3fn)  # K agrees (200) but is not a multiple of 128
    with pytest.raises(ValueError, match="multiple of 128"):
        gg.m_grouped_fp8_gemm_nt_contiguous(k200, a_s, k200.new_zeros(2, 128, 200), b_s, ip)
    with pytest.raises(ValueError, match="128x128 blocks"):
        gg.m_grouped_fp8_gemm_nt_contiguous(a, a_s, b, b_s[:, :, :1], ip)
    # masked: a is [G, max_m, K] with G = b's experts
    am, am_s = activations((3, 2, 256), seed=3)
    mm = torch.tensor([2, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"a must be \[G=2, max_m, K\], got \(3, 2, 256\)"):
        gg.m_grouped_fp8_gemm_nt_masked(am, am_s, b, b_s, mm)
    with pytest.raises(ValueError, match="masked_m must be int32"):
        gg.m_grouped_fp8_gemm_nt_masked(am[:2], am_s[:2], b, b_s, mm.long())


# ---------------------------------------------------------------------------------------------
# Variant selection
# ---------------------------------------------------------------------------------------------
def test_choose_variant_heuristic():
    for m in (0, 1, 16, 64):
        assert gg.choose_variant(m, 4096, 7168, 32, "NVIDIA H200") == "swapab"
    for m in (65, 256):
        assert gg.choose_variant(m, 4096, 7168, 32, "NVIDIA H200") == "normal"


def test_heuristic_config_boundaries():
    """The untuned tiles its docstring states: swapAB's token block covers m (16/32/64), 64-row weight tiles when
    128-row ones would leave SMs idle; normal 64-token tiles up to 128 tokens, then 128 on 8 warps."""
    bt = {m: gg.heuristic_config("swapab", m, 4096, 7168, 32)["BLOCK_T"] for m in (1, 16, 17, 32, 33, 64)}
    assert bt == {1: 16, 16: 16, 17: 32, 32: 32, 33: 64, 64: 64}
    assert gg.heuristic_config("swapab", 1, 4096, 7168, 4, num_sms=132)["BLOCK_N"] == 64  # 4 x 32 = 128 tiles
    assert gg.heuristic_config("swapab", 1, 4096, 7168, 5, num_sms=132)["BLOCK_N"] == 128  # 160 tiles
    normal = [gg.heuristic_config("normal", m, 4096, 7168, 32) for m in (128, 129)]
    assert [(c["BLOCK_T"], c["num_warps"]) for c in normal] == [(64, 4), (128, 8)]
    with pytest.raises(ValueError, match="variant must be one of"):
        gg.heuristic_config("wide", 8, 4096, 7168, 32)


def test_table_path_naming(monkeypatch):
    monkeypatch.delenv("SGLANG_H20_GEMM_TABLE")
    assert gemm_table.table_path("NVIDIA H200").name == "grouped_gemm_h200.json"
    assert gemm_table.table_path("NVIDIA H20").name == "grouped_gemm_h20.json"
    assert gemm_table.table_path("NVIDIA H100 80GB HBM3").name == "grouped_gemm_h100.json"
    assert gemm_table.table_path("NVIDIA H200").parent.name == "tables"


@pytest.mark.parametrize("name,key", [
    ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200"), ("NVIDIA H200 NVL", "h200-nvl"), ("NVIDIA H20", "h20"), ("NVIDIA H800 PCIe", "h800-pcie"),
    ("NVIDIA GH200 480GB", "gh200"), ("", "unknown"), ("NVIDIA", "unknown")])
def test_gpu_key_keeps_the_form_factor(name, key):
    """A PCIe or NVL card has other bandwidth than the SXM part of the same chip: it must not load that one's table."""
    assert gemm_table.gpu_key(name) == key


def test_an_h100_pcie_gets_no_table_and_the_mha_mla_tables_share_the_key(monkeypatch):
    from sglang_h20.attention import mha_mla

    monkeypatch.delenv("SGLANG_H20_GEMM_TABLE", raising=False)
    assert gemm_table.table_path("NVIDIA H100 PCIe").name == "grouped_gemm_h100-pcie.json"
    assert not gemm_table.table_path("NVIDIA H100 PCIe").exists()
    assert gemm_table.table_path("NVIDIA H100 80GB HBM3").exists()
    assert mha_mla.table_path("NVIDIA H100 NVL").name == "mha_mla_h100-nvl.json"
    assert mha_mla.table_path("NVIDIA H200").exists()


def test_choose_variant_from_table(monkeypatch, tmp_path):
    entries = [
        {"n": 4096, "k": 7168, "groups": 32, "m": 4, "best": "swapab",
         "config": {"swapab": {"BLOCK_N": 64, "BLOCK_T": 16, "num_stages": 5}}},
        {"n": 4096, "k": 7168, "groups": 32, "m": 32, "best": "upstream"},
        {"n": 4096, "k": 7168, "groups": 32, "m": 128, "best": "normal"},
        {"n": 4096, "k": 7168, "groups": 256, "m": 4, "best": "normal"},
        {"n": 128, "k": 256, "groups": 2, "m": 64, "best": "normal",
         "config": {"normal": {"BLOCK_N": 64, "BLOCK_T": 16}}},
    ]
    path = tmp_path / "grouped_gemm_test.json"
    path.write_text(json.dumps({"gpu": "test", "measured": False, "entries": entries}))
    monkeypatch.setenv("SGLANG_H20_GEMM_TABLE", str(path))
    cv = lambda m, g=32, n=4096, k=7168: gg.choose_variant(m, n, k, g, "test")  # noqa: E731
    assert cv(1) == "swapab" and cv(4) == "swapab"
    assert cv(5) == "upstream" and cv(32) == "upstream"
    assert cv(100) == "normal" and cv(4096) == "normal"  # beyond the table: its largest m
    assert cv(4, g=200) == "normal"  # nearest group count (log2)
    assert cv(4, g=40) == "swapab"
    assert cv(1, n=7168, k=2048) == "swapab" and cv(200, n=7168, k=2048) == "normal"  # no entry: heuristic
    cfg = gg.choose_config("swapab", 2, 4096, 7168, 32, "test")
    assert (cfg["BLOCK_N"], cfg["BLOCK_T"], cfg["num_stages"]) == (64, 16, 5)
    # 'auto' uses the table's variant and its tuned tiles (here normal with 64x16 tiles) and stays right
    a, a_s = activations((40, 256), seed=31)
    b, b_s = weights(2, 128, 256, seed=32)
    ip = torch.tensor([0, 13, 40], dtype=torch.int32)
    out = poisoned(40, 128)
    gg.m_grouped_fp8_gemm_nt_contiguous(a, a_s, b, b_s, ip, out=out)
    check_rows(out, gg.grouped_gemm_reference(a, a_s, b, b_s, m_indptr=ip), "auto from table")


def test_bad_table_is_reported(monkeypatch, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"entries": [{"n": 1, "k": 1, "groups": 1, "m": 1, "best": "fastest"}]}))
    monkeypatch.setenv("SGLANG_H20_GEMM_TABLE", str(path))
    with pytest.raises(ValueError, match="best"):
        gg.choose_variant(1, 1, 1, 1, "test")


# ---------------------------------------------------------------------------------------------
# Quantization
# ---------------------------------------------------------------------------------------------
def group_amax(x, group=128):
    return x.float().reshape(*x.shape[:-1], -1, group).abs().amax(-1).repeat_interleave(group, -1)


@pytest.mark.parametrize("shape", [(7, 256), (3, 5, 384)])
def test_per_token_group_round_trip(shape):
    x = torch.randn(*shape, generator=gen(41)) * torch.exp(torch.randn(*shape[:-1], 1, generator=gen(42)))
    q, s = per_token_group_quant_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (*shape[:-1], shape[-1] // 128)
    err = (dequant_per_token_group(q, s) - x).abs()
    assert (err <= group_amax(x) * QUANT_BOUND * (1 + 1e-6)).all()
    assert (q.float().abs().amax(-1) > 400).all()  # each row's largest group uses the top of the range


def test_per_block_round_trip():
    w = torch.randn(2, 200, 300, generator=gen(43)) * torch.exp(torch.randn(2, 1, 300, generator=gen(44)))
    q, s = per_block_quant_fp8(w)
    assert s.shape == (2, 2, 3)
    wp = torch.zeros(2, 256, 384)
    wp[:, :200, :300] = w
    amax = wp.abs().reshape(2, 2, 128, 3, 128).amax(dim=(2, 4))
    bound = amax.repeat_interleave(128, 1).repeat_interleave(128, 2)[:, :200, :300] * QUANT_BOUND
    assert ((dequant_per_block(q, s) - w).abs() <= bound * (1 + 1e-6)).all()


def check_silu_quant(q, s, x):
    inter = x.shape[-1] // 2
    y = torch.nn.functional.silu(x[..., :inter].float()) * x[..., inter:].float()
    qr, sr = silu_mul_quant_fp8_reference(x)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert torch.allclose(s, sr, rtol=1e-5, atol=0)
    deq = dequant_per_token_group(q, s)
    assert ((deq - y).abs() <= group_amax(y) * QUANT_BOUND * (1 + 1e-5)).all()
    mismatch = (q.float() != qr.float()).float().mean().item()
    assert mismatch <= 0.01, f"{mismatch:.3%} of fp8 values differ from the reference"  # ties only
    return mismatch


@pytest.mark.parametrize("rows,inter", [(1, 128), (9, 384), (33, 640)])
def test_silu_mul_quant(rows, inter):
    x = (torch.randn(rows, 2 * inter, generator=gen(rows)) * 2).to(torch.bfloat16)
    q, s = silu_mul_quant_fp8(x)
    assert q.shape == (rows, inter) and q.dtype == torch.float8_e4m3fn
    assert s.shape == (rows, inter // 128) and s.dtype == torch.float32
    check_silu_quant(q, s, x)


def test_silu_mul_quant_reads_a_strided_input():
    """x as a view with every stride other than 1 (a column slice of a wider buffer, every other element): the
    kernel reads it through its strides, as it does a contiguous one."""
    wide = (torch.randn(7, 4 * 256, generator=gen(57)) * 2).to(torch.bfloat16)
    x = wide[:, ::2]
    assert x.stride() == (4 * 256, 2)
    q, s = silu_mul_quant_fp8(x)
    assert q.shape == (7, 256) and s.shape == (7, 2)
    check_silu_quant(q, s, x.contiguous())


def test_silu_mul_quant_masked():
    masked = [0, 5, 12]
    x = (torch.randn(3, 12, 2 * 256, generator=gen(51)) * 3).to(torch.bfloat16)
    q, s = silu_mul_quant_fp8(x, masked_m=torch.tensor(masked, dtype=torch.int32))
    assert q.shape == (3, 12, 256) and s.shape == (3, 12, 2)
    for g, m in enumerate(masked):
        if m:
            check_silu_quant(q[g, :m], s[g, :m], x[g, :m])


def test_silu_then_down_gemm():
    """The MoE chain between up and down: silu_mul_quant_fp8 output feeds the masked GEMM as is."""
    masked = [4, 0, 11]
    h = (torch.randn(3, 16, 2 * 256, generator=gen(61)) * 2).to(torch.bfloat16)
    mm = torch.tensor(masked, dtype=torch.int32)
    q, s = silu_mul_quant_fp8(h, masked_m=mm)
    b, b_s = weights(3, 128, 256, seed=62)
    out = poisoned(3, 16, 128)
    gg.m_grouped_fp8_gemm_nt_masked(q, s, b, b_s, mm, out=out, variant="swapab")
    ref = gg.grouped_gemm_reference(q, s, b, b_s, masked_m=mm)
    for g, m in enumerate(masked):
        if m:
            check_rows(out[g, :m], ref[g, :m], f"chain group {g}")
        assert out[g, m:].isnan().all()


def test_tma_descriptors_only_for_dense_rows():
    """config tma builds descriptors for dense, 16-byte aligned operands (both layouts) and falls back to the
    pointer path (None) for anything else, e.g. a K-sliced view."""
    b = torch.zeros(3, 64, 256, dtype=torch.float8_e4m3fn)
    masked_a = torch.zeros(3, 8, 256, dtype=torch.float8_e4m3fn)
    contiguous_a = torch.zeros(20, 256, dtype=torch.float8_e4m3fn).unsqueeze(0)
    for a3 in (masked_a, contiguous_a):
        descs = gg._tma_descriptors(a3, b, 16, 64)
        assert descs is not None
        assert list(descs[0].shape) == [a3.shape[0] * a3.shape[1], 256] and list(descs[0].block_shape) == [16, 128]
        assert list(descs[1].shape) == [3 * 64, 256] and list(descs[1].block_shape) == [64, 128]
    sliced = torch.zeros(3, 8, 512, dtype=torch.float8_e4m3fn)[:, :, :256]
    assert gg._tma_descriptors(sliced, b, 16, 64) is None


@pytest.mark.parametrize("layout,split_k", [("dense", 2), ("dense", 4), ("masked", 4), ("contiguous", 2)])
def test_serial_reduce_equals_the_reduce_kernel_bit_for_bit(layout, split_k):
    """Config serial_reduce: the k-slice completing a tile sums the slices in the reduce kernel's order, so the
    output bits equal the two-launch form; rows outside the groups stay untouched; every counter is back at zero
    (the next launch on this stream reuses them), also after a second call."""
    n, k = 192, 512
    b, b_s = weights(3, n, k, seed=21)
    outs = []
    gg._fixup_buffers.clear()
    for serial in (False, True, True):
        cfg = {"serial_reduce": True} if serial else None
        if layout == "dense":
            a, a_s = activations((7, k), seed=22)
            out = poisoned(7, n)
            gg.fp8_gemm_nt(a, a_s, b[0], b_s[0], out=out, variant="swapab", split_k=split_k, config=cfg)
        elif layout == "masked":
            a, a_s = activations((3, 16, k), seed=23)
            out = poisoned(3, 16, n)
            mm = torch.tensor([6, 0, 13], dtype=torch.int32)
            gg.m_grouped_fp8_gemm_nt_masked(a, a_s, b, b_s, mm, out=out, variant="normal", split_k=split_k, config=cfg)
        else:
            a, a_s = activations((25, k), seed=24)
            out = poisoned(25, n)
            ip = cumsum0([4, 0, 19], start=1)
            gg.m_grouped_fp8_gemm_nt_contiguous(a, a_s, b, b_s, ip, out=out, variant="swapab", split_k=split_k,
                                                config=cfg)
        outs.append(out)
        if serial:
            (buf,) = [v for key, v in gg._fixup_buffers.items() if key[0] == "cpu"]
            assert int(buf.count_nonzero()) == 0
        else:
            assert not gg._fixup_buffers, "serial reduce without the config key"
    assert gg._fixup_buffers, "the serial-reduce path did not run"
    for other in outs[1:]:
        assert torch.equal(other.view(torch.int16), outs[0].view(torch.int16))  # NaN poison included
    assert not outs[0].isnan().all()
