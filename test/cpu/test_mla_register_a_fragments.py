"""The register A operand of version 3's P'V, modelled byte for byte on the CPU.

Each lane builds its FP8 wgmma A fragment of V^T from one ldmatrix.x4.trans of the SW64 K tile and four prmt. This
checks, for every warp, lane, 64-channel block and k-step, that fragment register a[i] byte b holds V[token][channel]
for the A row (g, or g + 8 for a[1] / a[3]) and k (4q + b, + 16 for a[2] / a[3]) that the PTX fragment layout
assigns to it, under the kernels' relabellings: A row g / g + 8 of warp w is channel 16w + 2g / + 1 of the block,
and k is the P' byte position of its token (kpos_of). The selectors, the lane address and the position map are read
out of the kernel source (csrc/mla_fp8_decode_sm90_v3.cu), so a wrong one there fails here, not on a GPU. The partial-tile masks zero exactly the tokens past
the end. The fragment layout itself (rows g / g + 8, k 4q .. 4q + 3 and + 16) was confirmed on the GPU by v3's
tests (outputs equal to version 2's within 1.4e-5, session 29).
"""
from __future__ import annotations

import importlib
import re

import numpy as np
import pytest

from repo_scripts import load_script

vt = load_script("benchmark/kernels/vt_transpose_model.py")
V3_SOURCE = importlib.import_module("sgl_kernel_ext.mla_decode_cuda").source_path(3).read_text()


def from_kernel(pattern: str) -> str:
    """The one match of `pattern`'s group in the v3 kernel source (a C integer expression or literal)."""
    found = re.findall(pattern, V3_SOURCE, re.S)
    assert len(found) == 1, (pattern, found)
    return found[0]


# C integer expressions of non-negative ints that read the same in Python (&, |, ^, ~, <<, >>, +, *)
KPOS_EXPR = from_kernel(r"constexpr int kpos_of\(int t\) \{\s*return (.+?);\s*\}")
V_OFF_EXPR = from_kernel(r"const uint32_t v_off = (.+?);")
SEL_LO, SEL_HI = (int(x, 16) for x in from_kernel(r"vt_fragment<(0x[0-9a-f]+)u, (0x[0-9a-f]+)u, MASK>"))


def smem_tile(rng):
    """A random 64-token x 576-byte K tile in the kernels' shared-memory layout: 9 SW64 blocks of 4 KB."""
    kv = rng.integers(0, 256, size=(64, 576), dtype=np.uint8)
    buf = np.zeros(9 * 4096, dtype=np.uint8)
    for t in range(64):
        for c in range(576):
            buf[(c // 64) * 4096 + vt.sw64(t, c % 64)] = kv[t, c]
    return kv, buf


def v_lane_offset(lane, w):
    """The kernel's per-lane ldmatrix row address in a K block (v3's v_off, read from its source): row 8j + i of a
    32-token step, the 16-byte chunk of channels 16w .. 16w + 15."""
    return eval(V_OFF_EXPR, {}, {"lj": lane >> 3, "li": lane & 7, "w": w})


def ldsm_x4_trans(buf, addrs):
    """ldmatrix.x4.trans (b16): matrix j's 8 rows at addrs[8j .. 8j + 7]; lane t gets, of each matrix, b16 column
    t // 4 of rows 2 (t % 4) and 2 (t % 4) + 1 (the lower half from the first)."""
    out = []
    for t in range(32):
        q, g = t % 4, t // 4
        regs = []
        for j in range(4):
            lo = vt.word(buf, addrs[8 * j + 2 * q] + 2 * g, 2)
            hi = vt.word(buf, addrs[8 * j + 2 * q + 1] + 2 * g, 2)
            regs.append(lo | (hi << 16))
        out.append(regs)
    return out


def kpos_v3(t):  # the v3 kernel's kpos_of, read from its source
    return eval(KPOS_EXPR, {}, {"t": t})


def test_the_source_expressions_are_what_the_model_expects():
    """Reading the kernel worked: the expressions found are the ones this model was written against (a change in
    the kernel shows here first, and the fragment test below says whether it is still right)."""
    assert (SEL_LO, SEL_HI) == (0x6420, 0x7531)
    assert [kpos_v3(t) for t in range(16)] == [0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15]
    assert [v_lane_offset(lane, 1) for lane in (0, 1, 2, 8)] == [16, 80, 128, 528]


@pytest.mark.parametrize("nvalid", [64, 37, 1])
def test_fragments_hold_the_relabelled_v_transpose(nvalid):
    rng = np.random.default_rng(7)
    kv, buf = smem_tile(rng)
    token_at = {kpos_v3(t): t for t in range(64)}
    assert sorted(token_at) == list(range(64))  # a permutation of the tile's positions
    for w in range(4):
        for mb in range(8):
            for ks in range(2):
                addrs = [mb * 4096 + ks * 2048 + v_lane_offset(lane, w) for lane in range(32)]
                regs = ldsm_x4_trans(buf, addrs)
                for lane in range(32):
                    q, g = lane % 4, lane // 4
                    r = list(regs[lane])
                    for j in range(4):  # the partial-tile mask of the kernels
                        tk = 32 * ks + 8 * j + 2 * q
                        r[j] &= (0x0000FFFF if tk < nvalid else 0) | (0xFFFF0000 if tk + 1 < nvalid else 0)
                    a = [vt.prmt(r[0], r[1], SEL_LO), vt.prmt(r[0], r[1], SEL_HI),
                         vt.prmt(r[2], r[3], SEL_LO), vt.prmt(r[2], r[3], SEL_HI)]
                    for i in range(4):
                        chan = 64 * mb + 16 * w + 2 * g + (i & 1)  # A row g (a0, a2) or g + 8 (a1, a3)
                        for byte in range(4):
                            k = 32 * ks + 16 * (i >> 1) + 4 * q + byte
                            tok = token_at[k]
                            want = kv[tok, chan] if tok < nvalid else 0
                            got = (a[i] >> (8 * byte)) & 0xFF
                            assert got == want, (w, mb, ks, lane, i, byte, tok, chan)


def test_v3_lane_tokens_and_their_p_positions():
    """v3's softmax lane (warp w, lane group g) holds S^T rows 16w + g and + 8 and stores them at kp0 and kp0 + 2."""
    for w in range(4):
        for g in range(8):
            t0 = 16 * w + g
            assert kpos_v3(t0 + 8) == kpos_v3(t0) + 2
            assert kpos_v3(t0) == 16 * w + 4 * (g >> 1) + (g & 1)


def test_the_ldmatrix_phases_are_conflict_free():
    """Each 8x8 matrix (8 row addresses of 16 bytes) of the fragments' ldmatrix hits 8 distinct 16-byte bank slots."""
    for w in range(4):
        for j in range(4):
            rows = [v_lane_offset(8 * j + i, w) for i in range(8)]
            assert vt.wavefronts([(a, 16) for a in rows]) == 1
