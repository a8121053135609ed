"""FP8 block-scaled grouped GEMMs on a Hopper GPU at DeepSeek-V3's real shapes.

MoE: gate_up (N=4096, K=7168) and down (N=7168, K=2048) with 8 and 32 experts per GPU and
m in {0, 1, 7, 32, 100, 256} tokens per expert (one expert empty, one at about m/2: uneven), both
layouts (contiguous, masked) and both variants (swapab, normal). Dense small-M linears through
fp8_gemm_nt: q_b (N=24576, K=1536), o_proj-like (N=7168, K=16384), fused qkv_a (N=2112, K=7168;
N is 16.5 scale blocks). Output poisoned with NaN; all valid elements checked against float32 on
the dequantized inputs (normwise and max-abs relative error <= 1e-2), other rows still NaN.
"""
import pytest
import torch
from gpu_checks import need_cuda_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_gemm_table")]

REL = 1e-2
MOE_SHAPES = {"gate_up": (4096, 7168), "down": (7168, 2048)}
DENSE_SHAPES = {"q_b": (24576, 1536), "o_proj": (7168, 16384), "qkv_a": (2112, 7168)}
MS = [0, 1, 7, 32, 100, 256]
WALK_CONFIGS = {"swapab": {"BLOCK_N": 128, "BLOCK_T": 16, "num_stages": 4, "programs_per_sm": 2},  # flat / tma tests
                "normal": {"BLOCK_N": 128, "BLOCK_T": 64, "num_stages": 3}}


@pytest.fixture(scope="module")
def mods():
    from sgl_kernel_ext import grouped_gemm_fp8 as gg
    from sgl_kernel_ext import quant

    torch.backends.cuda.matmul.allow_tf32 = False
    return gg, quant


def counts(m, groups):
    """m tokens for most experts, expert 1 empty, expert 2 about m/2 (uneven)."""
    c = [m] * groups
    c[1] = 0
    c[2] = (m + 1) // 2
    return c


def indptr_of(c, first=1):
    """The contiguous layout's per-group row offsets for counts c, the groups from row `first` on (1: a spare row
    before them, which no launch may write)."""
    return torch.tensor([first + sum(c[:i]) for i in range(len(c) + 1)], dtype=torch.int32, device="cuda")


def quantized_weights(quant, groups, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(groups, n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    return quant.per_block_quant_fp8(w)


def quantized_acts(quant, shape, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(*shape, device="cuda", generator=g) * torch.exp(
        torch.randn(*shape[:-1], 1, device="cuda", generator=g))
    return quant.per_token_group_quant_fp8(x)


def check(out, ref, what):
    o = out.float()
    assert torch.isfinite(o).all(), f"{what}: NaN/Inf in valid rows"
    norm_err = ((o - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    max_err = ((o - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    assert norm_err <= REL and max_err <= REL, f"{what}: normwise {norm_err:.2e}, max {max_err:.2e}"


def check_moe_points(quant, shape, groups, runs):
    """test_moe_shapes' points at one shape: m in MS tokens per expert (expert 1 empty, expert 2 about m/2), both
    layouts. runs: (label, masked(a, a_s, b, b_s, masked_m, out, m), contiguous(a, a_s, b, b_s, indptr, out)) each
    writing into `out`, poisoned with NaN: every valid row within REL of the float reference, rows of no expert
    still NaN (the contiguous layout has a spare row before and after the groups)."""
    n, k = MOE_SHAPES[shape]
    b, b_s = quantized_weights(quant, groups, n, k, seed=groups)
    bd = quant.dequant_per_block(b, b_s)  # fp32 reference weights, once per shape
    for m in MS:
        c = counts(m, groups)
        max_m = max(max(c), 1)
        a, a_s = quantized_acts(quant, (groups, max_m, k), seed=m)
        ad = quant.dequant_per_token_group(a, a_s)
        mm = torch.tensor(c, dtype=torch.int32, device="cuda")
        total = sum(c)
        ac, ac_s = quantized_acts(quant, (total + 2, k), seed=1000 + m)
        acd = quant.dequant_per_token_group(ac, ac_s)
        ip = indptr_of(c)
        for label, masked, contiguous in runs:
            out = torch.full((groups, max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            masked(a, a_s, b, b_s, mm, out, m)
            for g, cm in enumerate(c):
                if cm:
                    check(out[g, :cm], ad[g, :cm] @ bd[g].T, f"masked {shape} G={groups} m={m} {label} g={g}")
                assert out[g, cm:].isnan().all(), f"masked {label}: rows past masked_m written"
            out = torch.full((total + 2, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            contiguous(ac, ac_s, b, b_s, ip, out)
            for g in range(groups):
                lo, hi = ip[g].item(), ip[g + 1].item()
                if hi > lo:
                    check(out[lo:hi], acd[lo:hi] @ bd[g].T, f"contiguous {shape} G={groups} m={m} {label} g={g}")
            assert out[0].isnan().all() and out[-1].isnan().all(), f"{label}: rows outside the groups written"


@pytest.mark.parametrize("groups", [8, 32])
@pytest.mark.parametrize("shape", list(MOE_SHAPES))
def test_moe_shapes(mods, shape, groups):
    gg, quant = mods
    check_moe_points(quant, shape, groups, [
        (variant,
         lambda a, a_s, b, b_s, mm, out, m, v=variant: gg.m_grouped_fp8_gemm_nt_masked(
             a, a_s, b, b_s, mm, out=out, variant=v, expected_m=max(m, 1)),
         lambda a, a_s, b, b_s, ip, out, v=variant: gg.m_grouped_fp8_gemm_nt_contiguous(
             a, a_s, b, b_s, ip, out=out, variant=v))
        for variant in gg.VARIANTS])


@pytest.mark.parametrize("groups", [8, 32])
@pytest.mark.parametrize("shape", list(MOE_SHAPES))
def test_cuda_normal_variant_moe_shapes(mods, shape, groups):
    """The hand-written CUDA kernel (grouped_gemm_cuda: TMA producer, two math warp groups), every tile form, on
    test_moe_shapes' points."""
    from sgl_kernel_ext import grouped_gemm_cuda as ggc

    need_cuda_kernel(*ggc.available(), "the CUDA grouped GEMM")
    row_major = lambda s: s  # noqa: E731
    runs = [(form, row_major, "") for form in ggc.FORMS] + [
        (form, ggc.mn_major, " MN-major scales") for form in ("64x256-pd", "128x128-ds", "128x192-sm")]
    check_moe_points(mods[1], shape, groups, [
        (f"cuda {form}{tag}",
         lambda a, a_s, b, b_s, mm, out, m, f=form, sc=sc: ggc.m_grouped_fp8_gemm_nt_cuda(
             a, sc(a_s), b, b_s, masked_m=mm, out=out, form=f),
         lambda a, a_s, b, b_s, ip, out, f=form, sc=sc: ggc.m_grouped_fp8_gemm_nt_cuda(
             a, sc(a_s), b, b_s, m_indptr=ip, out=out, form=f))
        for form, sc, tag in runs])


def test_cuda_multicast_forms_repeat_bit_identically(mods):
    """The multicast forms' cluster protocol (peer writes into this CTA's slots, remote releases) under repetition:
    300 launches per form over grids of 2..132 CTAs (odd ones rounded down to whole clusters), uneven experts with
    an empty one and odd row-block counts (the weight-tile form's pairs with an empty second tile), each output
    bit-identical to the first launch's and that one within REL of the reference. A race shows as a mismatch; a lost
    arrival as the kernel's wait trap (a launch error), not a hang."""
    from sgl_kernel_ext import grouped_gemm_cuda as ggc

    need_cuda_kernel(*ggc.available(), "the CUDA grouped GEMM")
    quant = mods[1]
    n, k = MOE_SHAPES["down"]
    c = [37, 0, 128, 5, 200, 64, 1, 99]
    b, b_s = quantized_weights(quant, len(c), n, k, seed=7)
    a, a_s = quantized_acts(quant, (sum(c), k), seed=8)
    ip = indptr_of(c, first=0)
    ad, bd = quant.dequant_per_token_group(a, a_s), quant.dequant_per_block(b, b_s)
    ref = torch.cat([ad[ip[g]:ip[g + 1]] @ bd[g].T for g in range(len(c))])
    for form in (f for f in ggc.FORMS if f.endswith(("m", "b"))):  # token-tile and weight-tile multicast
        first = ggc.m_grouped_fp8_gemm_nt_cuda(a, a_s, b, b_s, m_indptr=ip, form=form)
        check(first, ref, f"multicast {form}")
        for i in range(300):
            out = ggc.m_grouped_fp8_gemm_nt_cuda(a, a_s, b, b_s, m_indptr=ip, form=form, num_sms=2 + i % 131)
            assert torch.equal(out, first), f"{form}: launch {i} (grid {2 + i % 131}) differs from the first"


@pytest.mark.parametrize("shape", list(DENSE_SHAPES))
def test_dense_shapes(mods, shape):
    gg, quant = mods
    n, k = DENSE_SHAPES[shape]
    b, b_s = quantized_weights(quant, 1, n, k, seed=n)
    b, b_s = b[0], b_s[0]
    bd = quant.dequant_per_block(b, b_s)
    for m in [1, 7, 32, 100, 256]:
        a, a_s = quantized_acts(quant, (m, k), seed=m + n)
        ref = quant.dequant_per_token_group(a, a_s) @ bd.T
        for variant in ("auto", *gg.VARIANTS):
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            gg.fp8_gemm_nt(a, a_s, b, b_s, out=out, variant=variant)
            check(out, ref, f"dense {shape} m={m} {variant}")


@pytest.mark.parametrize("shape", list(DENSE_SHAPES))
def test_serial_reduce_equals_the_reduce_kernel_under_stress_and_graphs(mods, shape):
    """Config serial_reduce (the last k-slice sums the tile): bit-equal to the reduce kernel's output for fresh inputs
    in a row (200 at 2 k-slices, 40 at 4 and 8) at M in {1, 37} (a lost or early arrival shows as a mismatch or NaN),
    the first of each within REL of the float reference, then in a CUDA graph replayed on new inputs (counters left
    at zero by every launch: the counter buffers exist, so the serial path ran)."""
    gg, quant = mods
    n, k = DENSE_SHAPES[shape]
    b, b_s = quantized_weights(quant, 1, n, k, seed=n + 1)
    b, b_s = b[0], b_s[0]
    kb = k // 128
    for m in (1, 37):
        for split_k in sorted({d for d in (2, 4, 8) if kb % d == 0 and kb // d >= 2}):
            cfg = {"BLOCK_N": 64, "serial_reduce": True}
            for i in range(200 if split_k == 2 else 40):
                a, a_s = quantized_acts(quant, (m, k), seed=1000 * split_k + i)
                two = gg.fp8_gemm_nt(a, a_s, b, b_s, variant="swapab", split_k=split_k, config={"BLOCK_N": 64})
                one = gg.fp8_gemm_nt(a, a_s, b, b_s, variant="swapab", split_k=split_k, config=cfg)
                assert torch.equal(one.view(torch.int16), two.view(torch.int16)), (shape, m, split_k, i)
                if i == 0:
                    check(one, gg.grouped_gemm_reference(a, a_s, b, b_s), f"serial reduce {shape} m={m} k/{split_k}")
            a, a_s = quantized_acts(quant, (m, k), seed=7)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                gg.fp8_gemm_nt(a, a_s, b, b_s, out=out, variant="swapab", split_k=split_k, config=cfg)
                with torch.cuda.graph(graph, stream=stream):
                    gg.fp8_gemm_nt(a, a_s, b, b_s, out=out, variant="swapab", split_k=split_k, config=cfg)
            torch.cuda.current_stream().wait_stream(stream)
            for seed in (8, 9, 10):
                a2, a2_s = quantized_acts(quant, (m, k), seed=seed)
                a.copy_(a2), a_s.copy_(a2_s)
                graph.replay()
                torch.cuda.synchronize()
                ref = gg.fp8_gemm_nt(a, a_s, b, b_s, variant="swapab", split_k=split_k, config={"BLOCK_N": 64})
                assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), (shape, m, split_k, "graph", seed)
    assert gg._fixup_buffers and all(int(buf.count_nonzero()) == 0 for buf in gg._fixup_buffers.values())


def test_silu_mul_quant(mods):
    gg, quant = mods
    for rows in (1, 37, 256):
        x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16) * 2
        q, s = quant.silu_mul_quant_fp8(x)
        qr, sr = quant.silu_mul_quant_fp8_reference(x)
        torch.testing.assert_close(s, sr, rtol=1e-5, atol=0)
        y = torch.nn.functional.silu(x[:, :2048].float()) * x[:, 2048:].float()
        amax = y.reshape(rows, -1, 128).abs().amax(-1).repeat_interleave(128, -1)
        assert ((quant.dequant_per_token_group(q, s) - y).abs() <= amax * 16 / 448 * (1 + 1e-5)).all()
        assert (q.float() != qr.float()).float().mean().item() <= 0.01


WS_CONFIGS = [("normal", {"BLOCK_N": 128, "BLOCK_T": 128, "num_stages": 4}),  # config ws: the map walk, not
              ("normal", {"BLOCK_N": 128, "BLOCK_T": 64}),                     # split (ws_split: see the last test)
              ("swapab", {"BLOCK_N": 128, "BLOCK_T": 32, "num_stages": 4})]


@pytest.mark.parametrize("walk", ["default", "tma", "ws"])
def test_masked_launch_is_graph_safe(mods, walk):
    """No host sync: a captured launch replays correctly after masked_m changes on the device (tma: the tensor
    descriptors are by-value kernel parameters, captured with the launch)."""
    gg, quant = mods
    groups, max_m, n, k = 8, 64, 4096, 7168
    b, b_s = quantized_weights(quant, groups, n, k, seed=3)
    a, a_s = quantized_acts(quant, (groups, max_m, k), seed=4)
    mm = torch.tensor([1] * groups, dtype=torch.int32, device="cuda")
    out = torch.empty(groups, max_m, n, dtype=torch.bfloat16, device="cuda")
    cfg = {"tma": {**WALK_CONFIGS["swapab"], "flat": True, "tma": True},
           "ws": {**WS_CONFIGS[2][1], "ws": True}}.get(walk)
    gg.m_grouped_fp8_gemm_nt_masked(a, a_s, b, b_s, mm, out=out, variant="swapab", expected_m=8, config=cfg)
    torch.cuda.synchronize()  # compiled
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gg.m_grouped_fp8_gemm_nt_masked(a, a_s, b, b_s, mm, out=out, variant="swapab", expected_m=8, config=cfg)
    mm.copy_(torch.tensor([0, 5, 64, 9, 0, 17, 33, 2], dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = gg.grouped_gemm_reference(a, a_s, b, b_s, masked_m=mm)
    for g, m in enumerate(mm.tolist()):
        if m:
            check(out[g, :m], ref[g, :m], f"graph replay g={g}")
        assert out[g, m:].isnan().all()


@pytest.mark.parametrize("streams", [1, 2])
@pytest.mark.parametrize("shape", list(MOE_SHAPES))
def test_split_variant_on_an_uneven_draw_and_under_graph_replay(mods, shape, streams):
    """variant split (swapAB on experts with <= split_at tokens, normal on the rest, by count on the device): an
    uneven draw with heavy, light and empty experts, both layouts, against float32 and no other row written; then
    captured once and replayed after the counts moved across the boundary (light experts turned heavy and back).
    streams 2: the halves on two streams, forked from and joined to the capturing one."""
    gg, quant = mods
    n, k = MOE_SHAPES[shape]
    groups, max_m = 16, 256
    b, b_s = quantized_weights(quant, groups, n, k, seed=11)
    a, a_s = quantized_acts(quant, (groups, max_m, k), seed=12)
    draws = [[256, 0, 3, 32, 33, 1, 0, 130, 17, 64, 2, 0, 9, 31, 200, 5],
             [1, 40, 0, 250, 2, 33, 32, 0, 7, 3, 100, 16, 0, 1, 12, 90]]
    mm = torch.tensor(draws[0], dtype=torch.int32, device="cuda")
    out = torch.full((groups, max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    cfg = {"split_at": 32, "split_streams": streams}

    def check_masked(c, what):
        ref = gg.grouped_gemm_reference(a, a_s, b, b_s, masked_m=mm)
        for g, m in enumerate(c):
            if m:
                check(out[g, :m], ref[g, :m], f"{what} {shape} g={g} m={m}")
            assert out[g, m:].isnan().all(), f"{what} {shape} g={g}: rows past masked_m written"

    gg.m_grouped_fp8_gemm_nt_masked(a, a_s, b, b_s, mm, out=out, variant="split", expected_m=48, config=cfg)
    check_masked(draws[0], "split masked")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gg.m_grouped_fp8_gemm_nt_masked(a, a_s, b, b_s, mm, out=out, variant="split", expected_m=48, config=cfg)
    for c in (draws[1], draws[0]):
        mm.copy_(torch.tensor(c, dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_masked(c, "split masked replay")
    c = draws[1]
    ac, ac_s = quantized_acts(quant, (sum(c) + 2, k), seed=13)
    ip = indptr_of(c)
    oc = torch.full((sum(c) + 2, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    gg.m_grouped_fp8_gemm_nt_contiguous(ac, ac_s, b, b_s, ip, out=oc, variant="split", config=cfg)
    ref = gg.grouped_gemm_reference(ac, ac_s, b, b_s, m_indptr=ip)
    for g in range(groups):
        lo, hi = ip[g].item(), ip[g + 1].item()
        if hi > lo:
            check(oc[lo:hi], ref[lo:hi], f"split contiguous {shape} g={g} m={hi - lo}")
    assert oc[0].isnan().all() and oc[-1].isnan().all(), "rows outside the groups written"


@pytest.mark.parametrize("shape", list(MOE_SHAPES))
def test_flat_and_tma_walks_match_the_plain_walk(mods, shape):
    """Configs flat and flat+tma compute the plain walk's tiles with the same K loop: the same bits, at the real
    shapes, both layouts and variants, uneven and empty groups. In the masked layout the rows past masked_m
    hold e4m3 NaN, which TMA boxes read and which must not reach a written row."""
    gg, quant = mods
    n, k = MOE_SHAPES[shape]
    groups = 8
    b, b_s = quantized_weights(quant, groups, n, k, seed=7)
    c = [40, 0, 3, 17, 64, 1, 0, 29]
    a, a_s = quantized_acts(quant, (groups, 64, k), seed=8)
    for g, m in enumerate(c):
        a.view(torch.uint8)[g, m:] = 0x7F
    mm = torch.tensor(c, dtype=torch.int32, device="cuda")
    total = sum(c)
    ac, ac_s = quantized_acts(quant, (total + 2, k), seed=9)
    ip = indptr_of(c)
    for variant, cfg in WALK_CONFIGS.items():
        outs = {}
        for walk, extra in (("plain", {}), ("flat", {"flat": True}), ("tma", {"flat": True, "tma": True})):
            om = torch.full((groups, 64, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            gg.m_grouped_fp8_gemm_nt_masked(a, a_s, b, b_s, mm, out=om, variant=variant, config={**cfg, **extra})
            oc = torch.full((total + 2, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            gg.m_grouped_fp8_gemm_nt_contiguous(ac, ac_s, b, b_s, ip, out=oc, variant=variant, config={**cfg, **extra})
            outs[walk] = (om, oc)
        for walk in ("flat", "tma"):
            for got, want, lay in zip(outs[walk], outs["plain"], ("masked", "contiguous")):
                assert torch.equal(got.isnan(), want.isnan()), f"{shape} {variant} {walk} {lay}: other rows written"
                assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want)), f"{shape} {variant} {walk} {lay}"
        ref = gg.grouped_gemm_reference(a, a_s, b, b_s, masked_m=mm)
        for g, m in enumerate(c):
            if m:
                check(outs["tma"][0][g, :m], ref[g, :m], f"tma masked {shape} {variant} g={g}")



@pytest.mark.parametrize("shape", list(MOE_SHAPES))
def test_register_cap_changes_no_bit(mods, shape):
    """Config maxnreg (ptxas' registers per thread capped so more programs are resident; 128 spills at 128 x 32)
    runs the same K loop: the same bits as the uncapped tile, both layouts, uneven and empty groups, and every row
    within the reference's bound."""
    gg, quant = mods
    n, k = MOE_SHAPES[shape]
    groups = 8
    b, b_s = quantized_weights(quant, groups, n, k, seed=17)
    c = [18, 0, 27, 14, 35, 114, 13, 1]
    a, a_s = quantized_acts(quant, (groups, 128, k), seed=18)
    mm = torch.tensor(c, dtype=torch.int32, device="cuda")
    total = sum(c)
    ac, ac_s = quantized_acts(quant, (total, k), seed=19)
    ip = indptr_of(c, first=0)
    for bn, stages in ((128, 3), (64, 4)):  # 128 x 32: a cap of 128 spills; 64 x 32: four per SM at 128
        outs = {}
        for cap in (None, 160, 128):
            cfg = {"BLOCK_N": bn, "BLOCK_T": 32, "num_stages": stages, "programs_per_sm": 16, "maxnreg": cap}
            om = torch.full((groups, 128, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            gg.m_grouped_fp8_gemm_nt_masked(a, a_s, b, b_s, mm, out=om, variant="swapab", config=cfg)
            oc = torch.empty(total, n, dtype=torch.bfloat16, device="cuda")
            gg.m_grouped_fp8_gemm_nt_contiguous(ac, ac_s, b, b_s, ip, out=oc, variant="swapab", config=cfg)
            outs[cap] = (om, oc)
        for cap in (160, 128):
            what = f"{shape} {bn}x32 {stages} stages maxnreg {cap}"
            assert torch.equal(outs[cap][0].isnan(), outs[None][0].isnan()), f"{what}: other rows written"
            assert torch.equal(torch.nan_to_num(outs[cap][0]), torch.nan_to_num(outs[None][0])), what
            assert torch.equal(outs[cap][1], outs[None][1]), what
        # both layouts of both configs against float32 (the capped runs equal these bit for bit)
        ref = gg.grouped_gemm_reference(a, a_s, b, b_s, masked_m=mm)
        for g, m in enumerate(c):
            if m:
                check(outs[128][0][g, :m], ref[g, :m], f"maxnreg 128 masked {shape} {bn}x32 g={g}")
        check(outs[128][1], gg.grouped_gemm_reference(ac, ac_s, b, b_s, m_indptr=ip),
              f"maxnreg 128 contiguous {shape} {bn}x32")


@pytest.mark.parametrize("shape", list(MOE_SHAPES))
def test_ws_config_matches_the_reference(mods, shape, monkeypatch):
    """Config ws (a token-tile map, then a persistent tile walk over TMA boxes; not warp-split) at the real shapes, both layouts: every valid row within REL of the float reference, rows
    past masked_m (e4m3 NaN in A, read by the boxes) and outside the contiguous groups never written, and the ws
    kernels are what ran."""
    gg, quant = mods
    n, k = MOE_SHAPES[shape]
    groups, max_m = 8, 256
    b, b_s = quantized_weights(quant, groups, n, k, seed=17)
    c = [256, 0, 3, 129, 64, 1, 255, 128]
    a, a_s = quantized_acts(quant, (groups, max_m, k), seed=18)
    for g, m in enumerate(c):
        a.view(torch.uint8)[g, m:] = 0x7F
    mm = torch.tensor(c, dtype=torch.int32, device="cuda")
    ref = gg.grouped_gemm_reference(a, a_s, b, b_s, masked_m=mm)
    total = sum(c)
    ac, ac_s = quantized_acts(quant, (total + 2, k), seed=19)
    ip = indptr_of(c)
    ref_c = gg.grouped_gemm_reference(ac, ac_s, b, b_s, m_indptr=ip)
    launched = []

    class Spy:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            launched.append(self.kernel)
            return self.kernel[grid]

    for name in ("_token_tile_map_kernel", "_fp8_grouped_gemm_ws_kernel"):
        monkeypatch.setattr(gg, name, Spy(getattr(gg, name)))
    for variant, cfg in WS_CONFIGS:
        om = torch.full((groups, max_m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        gg.m_grouped_fp8_gemm_nt_masked(a, a_s, b, b_s, mm, out=om, variant=variant, config={**cfg, "ws": True})
        oc = torch.full((total + 2, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        gg.m_grouped_fp8_gemm_nt_contiguous(ac, ac_s, b, b_s, ip, out=oc, variant=variant, config={**cfg, "ws": True})
        torch.cuda.synchronize()
        for g, m in enumerate(c):
            if m:
                check(om[g, :m], ref[g, :m], f"ws masked {shape} {variant} {cfg} g={g}")
            assert om[g, m:].isnan().all(), f"ws {shape} {variant} {cfg} g={g}: rows past masked_m written"
        check(oc[1:total + 1], ref_c[1:total + 1], f"ws contiguous {shape} {variant} {cfg}")
        assert oc[0].isnan().all() and oc[total + 1].isnan().all(), f"ws {shape} {variant}: rows outside written"
    assert len(launched) == 4 * len(WS_CONFIGS)


def test_ws_split_completes_where_it_did():
    """ws_split (Triton's warp-specialized loop) at normal 128x64, 3 stages, the one split case seen to complete on
    the H200 (5 others hung; config ws refuses the split without SGLANG_H20_WS_SPLIT=1, which the probe sets): run
    by probe_ws_walk in its own process under a timeout, so a hang fails this test instead of stalling the suite;
    every expert's rows within REL of the float reference."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "kernels"))
    import probe_ws_walk

    r = probe_ws_walk.probe(probe_ws_walk.case_of("normal-128x64", 5), timeout_s=120)
    assert r["status"] == "ok", r
    assert r["finite"] and r["max_rel_err"] <= REL, r
