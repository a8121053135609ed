"""The V transpose of the CUDA MLA kernels, modelled byte for byte (benchmark/kernels/vt_transpose_model.py): the
prmt transpose_v (the default until session 26), its conflict-free-store option and the ldmatrix/stmatrix forms
(the paired one is the default since session 27) all produce V^T exactly
(tokens past the end zero), and the bank-conflict counts the design option rests on hold."""
from __future__ import annotations

import pytest

from repo_scripts import load_script

model = load_script("benchmark/kernels/vt_transpose_model.py")


@pytest.fixture(scope="module")
def rec():
    return model.compare(seed=3, nvalid_list=(64, 63, 37, 8, 1))


def test_every_form_is_exact(rec):
    assert rec["exact"] and all(rec["exact"].values()), rec["exact"]


def test_the_option_halves_the_store_wavefronts_with_the_same_instructions(rec):
    """ncu counted 2.3 M bank conflicts in v2 at batch 64 x 4k; the prmt stores' 2-way conflicts are ~2.1 M."""
    w = rec["per_warp_per_block"]
    prmt, opt = w["prmt"], w["prmt_swizzled_stores"]
    assert (prmt["wavefronts_load"], prmt["wavefronts_store"]) == (32, 64)
    assert (opt["wavefronts_load"], opt["wavefronts_store"]) == (32, 32)  # 16 instructions x 2 phases: no conflict
    assert opt["instructions_per_thread"] == prmt["instructions_per_thread"] == 128
    cand = w["ldsm_stsm"]  # fewer instructions, but SW64 puts tokens r and r + 8 of one ldmatrix phase on one bank
    assert cand["instructions_per_thread"] == 80 and (cand["wavefronts_load"], cand["wavefronts_store"]) == (64, 32)
    assert w["ldsm_stsm_uniform_selectors"]["wavefronts_store"] == 64


def test_wavefronts_count_per_phase():
    # 8-byte lanes are served 16 at a time, 16-byte lanes 8 at a time
    assert model.wavefronts([(8 * i, 8) for i in range(32)]) == 2
    assert model.wavefronts([(0, 8)] * 16 + [(128, 8)] * 16) == 2  # same word in a phase: a broadcast
    assert model.wavefronts([(128 * (i % 2), 8) for i in range(16)]) == 2
    assert model.wavefronts([(16 * i, 16) for i in range(8)]) == 1
    assert model.wavefronts([(128 * i, 16) for i in range(8)]) == 8


@pytest.mark.parametrize("dloc0", [0, 64, 192, 448])
def test_the_kernels_xor_address_form_equals_the_sw64_formula(dloc0):
    """transpose_v computes its load and store offsets as (lane part) ^ (constant of the unrolled index); the
    identity holds for every lane, rep, index, and both store orders, at the channel offsets the kernels pass."""
    for swizzled in (False, True):
        for lane in range(32):
            for rep in range(2):
                cg8, xsw, _, tg = model.lane_fields(lane, rep)
                lane_off, z = model.store_lane_offset(lane, rep, dloc0, swizzled)
                for i in range(8):
                    assert model.load_lane_offset(lane, rep) ^ model.unrolled_bits(i) == model.sw64(8 * tg + (i ^ xsw),
                                                                                                   8 * cg8)
                    assert lane_off ^ model.unrolled_bits(i) == model.sw64(dloc0 + 8 * cg8 + (i ^ z), 8 * tg)


@pytest.mark.parametrize("dloc0", [0, 64, 192, 448])
def test_the_ldsm_options_address_form_equals_the_sw64_formula(dloc0):
    """-DMLA_VT_LDSM computes its ldmatrix / stmatrix row addresses as a lane base plus / XOR the unrolled (tb, cb)
    terms; at the channel offsets the kernels pass, they are the rows the byte-exact model reads and writes."""
    for lane in range(32):
        j, i = divmod(lane, 8)
        base, c32 = model.stsm_lane_base(lane, dloc0)
        for tb in range(4):
            for cb in range(2):
                assert (model.ldsm_lane_base(lane) + 1024 * tb) ^ (cb << 5) == \
                    model.sw64(16 * tb + 2 * i + (j & 1), 16 * (2 * cb + (j >> 1)))
                assert (base + 2048 * cb) ^ (tb << 4) == model.sw64(dloc0 + 32 * cb + c32, 16 * tb)


def test_paired_p_prime_stores_match_the_paired_v_transpose():
    """The default (paired) form: the softmax stores the b16 of (token 16c + 2q4 + e, token + 8) at byte 16c +
    pv_k_pos(2q4 + e) of its P' row (both kernels); each token's P' byte then sits at the k position where the
    paired V^T put that token's V, and the 16 positions of a chunk are each written once."""
    for c in range(4):
        seen = set()
        for q4 in range(4):
            for e in range(2):
                low, high = 16 * c + 2 * q4 + e, 16 * c + 8 + 2 * q4 + e
                at = 16 * c + model.pv_k_pos(2 * q4 + e, True)
                for byte, token in ((at, low), (at + 1, high)):
                    assert byte == 16 * (token // 16) + model.pv_k_pos(token % 16, True)
                    seen.add(byte)
        assert seen == set(range(16 * c, 16 * c + 16))
