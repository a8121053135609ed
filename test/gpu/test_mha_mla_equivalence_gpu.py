"""On a Hopper GPU: SGLang 0.5.17's MHA and absorbed-MLA prefill paths give the same attention output.

The paths are the benchmark's (sglang_h20.attention.mha_mla_measure), run with each kernel provider that
works on the host (the other is skipped, with the reason; all are skipped where neither runs):
flashinfer, what `--attention-backend flashmla` runs for prefill (FlashMLABackend delegates it to
FlashInferMLAAttnBackend): MHA one shot (latent gather, kv_b_proj, concat_mla_k, causal ragged prefill over
prefix + new tokens), MHA with a chunked prefix (ragged prefill with lse per chunk, merge_state_v2) and absorbed
MLA (W_UK bmm, BatchMLAPagedAttentionWrapper over the latent cache in 64-token pages, W_UV bmm); fa3, what
`--attention-backend fa3` runs (fa3 varlen; fa3 kvcache with qv), where sgl_kernel ships FA3. Random non-zero
weights and inputs, DeepSeek-V3 shapes (128 heads, kv_lora 512, nope 128, rope 64, v 128), bf16.

Error metric: rel = ||out - ref||_F / ||ref||_F on the [tokens, 128, 128] output that o_proj reads.
Bounds: MHA vs MLA and each vs float32 <= 2e-2 (both are bf16 end to end: expected well under 1%);
the float32 reference in its latent form vs its expanded (per-head K/V) form <= 1e-5;
--kv-b-proj fp8 (an FP8 GEMM of the FP8-quantized latent) vs float32 <= 5e-2.
Each case prints its errors (pytest -s) so that a run records them.
"""
from __future__ import annotations


import pytest

pytestmark = pytest.mark.gpu

from sglang_h20.attention.mha_mla import MLA_MAX_EXTEND_TOKENS
from sglang_h20.attention import mha_mla_measure as bench  # what benchmark/attention/mha_mla_layer.py runs

CAPACITY = 128 * 1024
# (extend per request, prefix per request, chunk capacity): the capacity decides one shot vs chunked prefix
CASES = {
    "fresh_1x256": ([256], [0], CAPACITY),
    "fresh_mixed": ([1, 77, 300], [0, 0, 0], CAPACITY),
    "one_shot_mixed": ([37, 200, 64], [300, 0, 129], CAPACITY),
    "one_shot_4x128_on_1k": ([128] * 4, [1024] * 4, CAPACITY),
    "chunked_8_chunks_some_empty": ([37, 200, 64], [300, 0, 129], 128),
    "chunked_2x512_on_4k": ([512, 512], [4096, 4096], 4096),
    "chunked_no_prefix": ([700, 300], [0, 0], 512),
}


@pytest.fixture(scope="module", params=bench.PROVIDERS)
def kernels(request):
    """Each provider that imports here, its JIT kernels built once (a build failure is a failure, not a skip)."""
    try:
        k = bench.load_kernels("bf16", request.param)
    except bench.Unavailable as e:
        pytest.skip(f"{request.param} kernels cannot run here: {e}")
    print(f"\n{request.param}: built in {bench.compile_kernels(k, bench.Layer(k))} s")
    return k


@pytest.fixture(scope="module")
def layer(kernels):
    return bench.Layer(kernels)


def outputs(k, layer, extend, prefix, capacity, seed=0):
    import torch

    X = bench.Batch(k, extend, prefix, capacity, seed=seed)
    mha, mla = bench.mha_forward(k, layer, X), bench.mla_forward(k, layer, X)
    torch.cuda.synchronize()
    return X, mha, mla


@pytest.mark.parametrize("case", list(CASES))
def test_mha_and_mla_agree_with_each_other_and_with_float32(case, kernels, layer):
    import torch

    extend, prefix, capacity = CASES[case]
    X, mha, mla = outputs(kernels, layer, extend, prefix, capacity, seed=len(case))
    assert mha.shape == mla.shape == (sum(extend), bench.HEADS, bench.V_DIM)
    assert torch.isfinite(mha.float()).all() and torch.isfinite(mla.float()).all()
    assert mha.float().norm() > 0
    worst = {"mha": 0.0, "mla": 0.0}
    for i, e in enumerate(extend):
        q0 = sum(extend[:i])
        ref = bench.reference_rows(kernels, layer, X, i, list(range(e)), expanded=True)
        worst["mha"] = max(worst["mha"], bench.rel(mha[q0:q0 + e], ref))
        worst["mla"] = max(worst["mla"], bench.rel(mla[q0:q0 + e], ref))
    between = bench.rel(mha, mla)
    print(f"\n{case}: {'one shot' if X.one_shot else f'chunked ({len(X.chunks)} prefix chunks)'}; "
          f"rel MHA vs MLA {between:.4f}, MHA vs fp32 {worst['mha']:.4f}, MLA vs fp32 {worst['mla']:.4f}; "
          f"concat: {kernels.notes['concat_k']}")
    assert X.one_shot == (capacity == CAPACITY)
    assert between <= 2e-2
    assert worst["mha"] <= 2e-2
    assert worst["mla"] <= 2e-2


def test_chunked_mha_at_full_capacity(kernels, layer):
    """The benchmark's largest off-grid batch (12 requests, 135k tokens: MHA with 128k-token prefix chunks).
    On the H200 (2026-11-29) its check gave rel 0.97 between MHA and MLA, while every smaller chunked case
    agreed: MHA was right (0.003 vs float32) and MLA gave inf, its batch having 31911 new tokens: flashinfer's MLA
    prefill overflows int32 at tokens x 128 x 576, so the validation points now stay below MAX_EXTEND_TOKENS."""
    import torch

    pt = {"extend": [526, 2935, 1862, 1745, 999, 2633, 1029, 1083, 2551, 168, 318, 62],  # 15911 new tokens
          "prefix": [27620, 3328, 571, 1157, 0, 0, 958, 0, 50000, 0, 7363, 27268]}  # 134k tokens in all
    assert sum(pt["extend"]) <= MLA_MAX_EXTEND_TOKENS
    X = bench.Batch(kernels, pt["extend"], pt["prefix"], CAPACITY, seed=3)
    assert not X.one_shot
    mha, mla = bench.mha_forward(kernels, layer, X), bench.mla_forward(kernels, layer, X)
    torch.cuda.synchronize()
    worst = {"mha": 0.0, "mla": 0.0}
    for i, e in enumerate(X.extend):
        q0, rows = sum(X.extend[:i]), list(range(max(0, e - 4), e))
        ref = bench.reference_rows(kernels, layer, X, i, rows)  # latent form: 135k tokens stay small
        worst["mha"] = max(worst["mha"], bench.rel(mha[q0 + rows[0]:q0 + e], ref))
        worst["mla"] = max(worst["mla"], bench.rel(mla[q0 + rows[0]:q0 + e], ref))
    print(f"\nfull capacity: B={len(X.extend)}, {len(X.chunks)} chunks, prefixes {pt['prefix']}: "
          f"MHA vs fp32 {worst['mha']:.4f}, MLA vs fp32 {worst['mla']:.4f}")
    assert worst["mha"] <= 2e-2 and worst["mla"] <= 2e-2


def test_reference_forms_agree(kernels, layer):
    X = bench.Batch(kernels, [64, 100], [500, 0], CAPACITY, seed=9)
    for i, e in enumerate(X.extend):
        rows = list(range(e))
        a = bench.reference_rows(kernels, layer, X, i, rows)
        b = bench.reference_rows(kernels, layer, X, i, rows, expanded=True)
        assert bench.rel(a, b) <= 1e-5


def test_one_shot_and_chunked_mha_agree(kernels, layer):
    """The same batch through both MHA variants (upstream picks by the chunk capacity)."""
    X = bench.Batch(kernels, [200, 64], [1000, 129], 256, seed=4)
    chunked, one_shot = bench.mha_forward(kernels, layer, X, chunked=True), bench.mha_forward(kernels, layer, X,
                                                                                               chunked=False)
    r = bench.rel(chunked, one_shot)
    print(f"\nchunked ({len(X.chunks)} chunks) vs one shot: rel {r:.4f}")
    assert len(X.chunks) > 1 and r <= 2e-2


def test_startup_check_of_the_benchmark_passes(kernels, layer):
    res = bench.startup_check(kernels, layer)
    print(f"\nstartup check: {res}")
    assert res["ok"], res


def test_a_benchmark_point_checks_and_times_both_paths(kernels, layer):
    import torch

    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    row = bench.run_point(kernels, layer, {"batch": 2, "extend": 512, "prefix": 4096}, 10.0, flush, seed=1)
    print(f"\npoint: MHA {row['mha_us']:.1f} us, MLA {row['mla_us']:.1f} us, check {row['check']}")
    assert row["mha_us"] > 0 and row["mla_us"] > 0 and row["mha_variant"] == "one_shot"
    assert row["check"]["max_rel"] <= 2e-2


def test_fp8_kv_b_proj_variant(kernels):
    try:
        k = bench.load_kernels("fp8", kernels.provider)
    except bench.Unavailable as e:  # a missing kernel; any other error (a changed signature) fails the test
        pytest.skip(f"FP8 kv_b_proj path does not load: {e}")
    layer = bench.Layer(k)
    X, mha, mla = outputs(k, layer, [37, 200, 64], [300, 0, 129], CAPACITY, seed=2)
    ref = bench.reference_rows(k, layer, X, 0, list(range(37)), expanded=True)
    r_ref, r_between = bench.rel(mha[:37], ref), bench.rel(mha, mla)
    print(f"\nfp8 kv_b_proj: MHA vs fp32 {r_ref:.4f}, MHA vs MLA {r_between:.4f}")
    assert r_ref <= bench.TOLERANCE_FP8 and r_between <= bench.TOLERANCE_FP8


def test_flashinfer_lse_is_base_2_so_the_merge_converts_it(kernels, layer):
    """Why the chunked path multiplies flashinfer's lse by ln 2: merged as SGLang 0.5.17 does (as is), the
    result is visibly off (sgl-project/sglang#40903); converted, it matches float32."""
    if kernels.provider != "flashinfer":
        pytest.skip("flashinfer only")
    X = bench.Batch(kernels, [256], [4096], 1024, seed=6)
    ref = bench.reference_rows(kernels, layer, X, 0, list(range(256)), expanded=True)
    good = bench.rel(bench.mha_forward(kernels, layer, X, chunked=True), ref)
    as_upstream = bench.rel(bench.mha_forward(kernels, layer, X, chunked=True, lse_to_e=False), ref)
    print(f"\nchunked ({len(X.chunks)} chunks) vs fp32: lse x ln2 {good:.4f}, lse as is (SGLang 0.5.17) "
          f"{as_upstream:.4f}")
    assert good <= 2e-2 < as_upstream
