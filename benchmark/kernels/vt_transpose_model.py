#!/usr/bin/env python3
"""The FP8 MLA kernels' V transpose, modelled on the CPU: `transpose_v` in each form the kernels build (the prmt
form, the default until session 26, now `-DMLA_VT_PRMT`; `-DMLA_VT_STORE_SWIZZLE`; `-DMLA_VT_LDSM`: `ldmatrix.x4`
+ `prmt` + `stmatrix.x4.trans` (b16); and the default since session 27, the same with tokens l and l + 8 paired),
byte-exact, shared-memory wavefronts counted.

Why: FP8 wgmma on sm_90 has no transposed-B mode, so P'V needs Vᵀ (channels x tokens, K-major) while the cache
holds V token-major. In the session-9 trace each math warpgroup of v2 spent 21-23% of its span transposing, and
v2 is bound by CUDA-core instructions (92 M issued against FlashMLA BF16's 26 M). The ldmatrix form moves 16 bytes
per lane per instruction instead of 8 and lets `stmatrix.trans` do the 2-byte half of the transpose, so it issues
fewer instructions per tile; whether that wins on the GPU depends also on the wavefronts (below), which is what
this model counts. Nothing here runs on a GPU or times anything.

Model: one warp transposes one SW64 K block (64 tokens x 64 channel bytes, `sw64()` of
`csrc/mla_fp8_sm90_common.cuh`) into a 64-channel x 64-token SW64 Vᵀ block. `prmt`, `ldmatrix` and `stmatrix`
follow the PTX ISA's fragment layouts (thread t holds row t // 4, b16 columns 2 (t % 4) and + 1 of each 8x8
matrix; lanes 8j..8j+7 give the row addresses of matrix j). Wavefronts: per 128-byte phase of a warp instruction
(16 lanes of 8 B, 8 lanes of 16 B), the most distinct 4-byte words in one bank, summed (`wavefronts`).

usage: python benchmark/kernels/vt_transpose_model.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

SEL_EVEN_ODD_LO, SEL_EVEN_ODD_HI = 0x5140, 0x7362  # prmt: bytes 0,1 / 2,3 of a and b interleaved (a first)


def sw64(row: int, k: int) -> int:
    """Byte offset of (row, byte k) in an SW64 block (the kernels' `sw64`)."""
    return (row >> 3) * 512 + (row & 7) * 64 + ((((k >> 4) ^ ((row & 7) >> 1)) & 3) << 4) + (k & 15)


def prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def wavefronts(accesses: list[tuple[int, int]]) -> int:
    """One warp instruction's per-lane (byte address, bytes) accesses, in lane order: shared memory serves them in
    phases of 128 bytes (32 lanes of 4 B, 16 of 8 B, 8 of 16 B: one 8x8 matrix of ldmatrix / stmatrix); a phase
    takes as many wavefronts as the most distinct 4-byte words that fall into one of the 32 banks."""
    per_phase = 128 // accesses[0][1]
    total = 0
    for p0 in range(0, len(accesses), per_phase):
        banks: dict[int, set[int]] = {}
        for addr, size in accesses[p0:p0 + per_phase]:
            for w in range(addr // 4, (addr + size) // 4):
                banks.setdefault(w % 32, set()).add(w)
        total += max(len(v) for v in banks.values())
    return total


def word(buf: np.ndarray, addr: int, size: int = 4) -> int:
    return int.from_bytes(buf[addr:addr + size].tobytes(), "little")


def lane_fields(lane: int, rep: int) -> tuple[int, int, int, int]:
    """transpose_v's per-lane indices: (cg8: the lane's 8-channel group, xsw: rows loaded pair-swapped, zsw: stores
    channel c ^ 1, tg: the 8-token group of this rep)."""
    cg8, xsw, zsw = lane & 7, (lane >> 3) & 1, lane & 1
    return cg8, xsw, zsw, xsw | (((lane >> 4) & 1) << 1) | ((((lane >> 2) & 1) ^ rep) << 2)


def unrolled_bits(i: int) -> int:
    """The kernels' `sw64_unrolled_bits`: bits 4-8 of an SW64 offset that depend on the unrolled index (token slot i
    of a load, channel slot i of a store), XORed into one per-lane offset."""
    return (i << 6) | ((i >> 1) << 4)


def load_lane_offset(lane: int, rep: int) -> int:
    """transpose_v's `lane_ld`: the load of slot i is at lane_ld ^ unrolled_bits(i) (token 8 tg + (i ^ xsw))."""
    cg8, xsw, _, tg = lane_fields(lane, rep)
    return (tg * 512 + (cg8 & 1) * 8) | (xsw << 6) | (((cg8 >> 1) & 3) << 4)


def store_lane_offset(lane: int, rep: int, dloc0: int, swizzled_stores: bool) -> tuple[int, int]:
    """transpose_v's (`lane_off`, z): channel slot c is stored at lane_off ^ unrolled_bits(c), V^T row
    dloc0 + 8 cg8 + (c ^ z)."""
    cg8, _, zsw, tg = lane_fields(lane, rep)
    z = zsw | ((lane & 2) if swizzled_stores else 0)
    return (((dloc0 >> 3) + cg8) * 512 + (tg & 1) * 8) | (z << 6) | ((((tg >> 1) ^ (z >> 1)) & 3) << 4), z


def transpose4(x: list[int], sa: int, sb: int, ta: int, tb: int) -> list[int]:
    """The kernels' `transpose4`."""
    t0, t1, t2, t3 = prmt(x[0], x[1], sa), prmt(x[0], x[1], sb), prmt(x[2], x[3], sa), prmt(x[2], x[3], sb)
    return [prmt(t0, t2, ta), prmt(t0, t2, tb), prmt(t1, t3, ta), prmt(t1, t3, tb)]


def prmt_form(src: np.ndarray, nvalid: int, swizzled_stores: bool = False) -> tuple[np.ndarray, dict]:
    """`transpose_v` as written (one warp, dloc0 = 0; its XOR address form asserted equal to the SW64 formula):
    2 reps x (8 LDS.64, 16 prmt x 2, 8 STS.64). Its stores take two wavefronts per half-warp phase: the 16 lanes of a phase write 8 distinct 8-byte bank slots, twice.
    swizzled_stores (-DMLA_VT_STORE_SWIZZLE): lanes with bit 1 set swap their first-stage selectors, so their
    transpose4 outputs come out as channels c ^ 2, and store them there: same instructions, one wavefront each."""
    dst = np.zeros(64 * 64, np.uint8)
    stats = {"lds64": 0, "sts64": 0, "prmt": 0, "sel": 0, "wavefronts_load": 0, "wavefronts_store": 0}
    for rep in range(2):
        lo = [[0] * 8 for _ in range(32)]
        hi = [[0] * 8 for _ in range(32)]
        for i in range(8):
            acc = []
            for lane in range(32):
                cg8, xsw, _, tg = lane_fields(lane, rep)
                k = i ^ xsw
                addr = load_lane_offset(lane, rep) ^ unrolled_bits(i)
                assert addr == sw64(8 * tg + k, 8 * cg8)
                acc.append((addr, 8))
                ok = tg * 8 + k < nvalid
                lo[lane][i] = word(src, addr) if ok else 0
                hi[lane][i] = word(src, addr + 4) if ok else 0
            stats["wavefronts_load"] += wavefronts(acc)
        stats["lds64"] += 8
        stats["sel"] += 16
        acc_c: list[list[tuple[int, int]]] = [[] for _ in range(8)]
        for lane in range(32):
            cg8, xsw, zsw, tg = lane_fields(lane, rep)
            lane_off, z = store_lane_offset(lane, rep, 0, swizzled_stores)
            sa, sb = (0x1504, 0x3726) if xsw else (SEL_EVEN_ODD_LO, SEL_EVEN_ODD_HI)
            if z & 2:  # the option: first-stage selectors swapped, outputs come out as channels c ^ 2
                sa, sb = sb, sa
            sc, sd = (0x7632, 0x5410) if zsw else (0x5410, 0x7632)
            tlo = transpose4(lo[lane][0:4], sa, sb, sc, sd) + transpose4(hi[lane][0:4], sa, sb, sc, sd)
            thi = transpose4(lo[lane][4:8], sa, sb, sc, sd) + transpose4(hi[lane][4:8], sa, sb, sc, sd)
            for c in range(8):
                addr = lane_off ^ unrolled_bits(c)
                assert addr == sw64(cg8 * 8 + (c ^ z), 8 * tg)
                dst[addr:addr + 4] = np.frombuffer(tlo[c].to_bytes(4, "little"), np.uint8)
                dst[addr + 4:addr + 8] = np.frombuffer(thi[c].to_bytes(4, "little"), np.uint8)
                acc_c[c].append((addr, 8))
        stats["prmt"] += 32
        stats["sts64"] += 8
        stats["wavefronts_store"] += sum(wavefronts(a) for a in acc_c)
    return dst, stats


def pair_tokens(i: int, paired: bool) -> tuple[int, int]:
    """The two tokens (within a 16-token chunk) of b16 pair i of P' and V^T: 2i, 2i + 1, or i, i + 8 (paired)."""
    return (i, i + 8) if paired else (2 * i, 2 * i + 1)


def pv_k_pos(l: int, paired: bool) -> int:
    """The kernels' pv_k_pos: byte position of token l in its 16-token chunk of P' and V^T."""
    return (2 * l if l < 8 else 2 * (l - 8) + 1) if paired else l


def ldsm_lane_base(lane: int, paired: bool = False) -> int:
    """-DMLA_VT_LDSM's ldmatrix row address of this lane (matrix j = lane // 8: token pair_tokens(i)[j & 1] of
    pair i = lane % 8, channel chunk 2 cb + (j >> 1)) for token chunk tb and channel half cb: (base + 1024 tb) ^
    (cb << 5). paired (the default form): the 8 rows of a phase are 8 consecutive tokens, conflict-free."""
    j, i = divmod(lane, 8)
    if paired:
        return (j & 1) * 512 + i * 64 + ((((j >> 1) ^ (i >> 1)) & 3) << 4)
    return (i >> 2) * 512 + (2 * (i & 3) + (j & 1)) * 64 + (((j >> 1) ^ (i & 3)) << 4)


def stsm_lane_base(lane: int, dloc0: int) -> tuple[int, int]:
    """-DMLA_VT_LDSM's stmatrix row (stored row k = lane % 8 of matrix m = lane // 8) as (base, channel within the
    block's 32-channel half): the address for token chunk tb and channel half cb is (base + 2048 cb) ^ (tb << 4)."""
    m, k = divmod(lane, 8)
    qq, e = divmod(k, 2)                  # column k of matrix m is held by the threads with t % 4 == qq
    half = (m & 1) ^ (qq >> 1)            # lanes t % 4 >= 2 swapped their interleave selectors
    d7 = 4 * (qq & 1) + 2 * half + e      # the channel's row within its 8-row group
    base = ((dloc0 >> 3) + 2 * (m >> 1) + (qq >> 1)) * 512 + d7 * 64 + ((d7 >> 1) << 4)
    return base, 16 * (m >> 1) + 4 * qq + 2 * half + e


def ldsm_stsm(src: np.ndarray, nvalid: int, lane_selectors: bool = True, paired: bool = False
              ) -> tuple[np.ndarray, dict]:
    """-DMLA_VT_LDSM (paired: the default form): per 16 tokens x 32 channels, one ldmatrix.x4 (the first /
    second tokens of each pair, of two 16-byte channel chunks), four prmt (the pair's bytes interleaved: b16
    elements), one stmatrix.x4.trans (the b16 transpose puts each channel's 16 tokens in one 16-byte row of Vᵀ).
    lane_selectors: lanes with t % 4 >= 2 swap the two interleave selectors (and the stores' channel rows with
    them), so that the 8 rows of each stored matrix have 8 different channels mod 8: conflict-free stores under
    SW64."""
    dst = np.zeros(64 * 64, np.uint8)
    stats = {"ldsm_x4": 0, "stsm_x4": 0, "prmt": 0, "sel": 0, "wavefronts_load": 0, "wavefronts_store": 0}
    for tb in range(4):          # 16-token chunk of the tile
        for cb in range(2):      # 32-channel half of the K block
            rows = []            # ldmatrix row addresses: lane L -> matrix L // 8, row L % 8
            for lane in range(32):
                j, i = divmod(lane, 8)
                rows.append(sw64(16 * tb + pair_tokens(i, paired)[j & 1], 16 * (2 * cb + (j >> 1))))
                assert rows[-1] == (ldsm_lane_base(lane, paired) + 1024 * tb) ^ (cb << 5)  # the kernel's form
            stats["wavefronts_load"] += wavefronts([(a, 16) for a in rows])
            stats["ldsm_x4"] += 1
            regs = []
            for t in range(32):  # register j of thread t: bytes 4 (t % 4) .. +3 of row t // 4 of matrix j
                r = []
                for j in range(4):
                    tok = 16 * tb + pair_tokens(t // 4, paired)[j & 1]
                    r.append(word(src, rows[8 * j + t // 4] + 4 * (t % 4)) if tok < nvalid else 0)
                regs.append(r)
            stats["sel"] += 4
            out = []
            for t in range(32):
                swap = lane_selectors and t % 4 >= 2
                s_lo, s_hi = (SEL_EVEN_ODD_HI, SEL_EVEN_ODD_LO) if swap else (SEL_EVEN_ODD_LO, SEL_EVEN_ODD_HI)
                r = regs[t]
                out.append([prmt(r[0], r[1], s_lo), prmt(r[0], r[1], s_hi), prmt(r[2], r[3], s_lo),
                            prmt(r[2], r[3], s_hi)])
            stats["prmt"] += 4
            store_rows = []      # stmatrix.trans: lane 8m + k gives the address of stored row k of matrix m
            for lane in range(32):
                m, k = divmod(lane, 8)
                qq, e = divmod(k, 2)                # column k of matrix m is held by threads t % 4 == qq
                half = (m & 1) ^ (1 if lane_selectors and qq >= 2 else 0)
                chan = 16 * (2 * cb + (m >> 1)) + 4 * qq + 2 * half + e
                store_rows.append(sw64(chan, 16 * tb))
                if lane_selectors:  # the kernel's form (dloc0 = 0)
                    base, c32 = stsm_lane_base(lane, 0)
                    assert c32 + 32 * cb == chan and store_rows[-1] == (base + 2048 * cb) ^ (tb << 4)
            stats["wavefronts_store"] += wavefronts([(a, 16) for a in store_rows])
            stats["stsm_x4"] += 1
            for m in range(4):
                for k in range(8):
                    base = store_rows[8 * m + k]
                    for i in range(8):              # element (i, k) of matrix m: thread 4 i + k // 2, half k % 2
                        v = (out[4 * i + k // 2][m] >> (16 * (k % 2))) & 0xFFFF
                        dst[base + 2 * i], dst[base + 2 * i + 1] = v & 0xFF, v >> 8
    return dst, stats


def as_vt(dst: np.ndarray, paired: bool = False) -> np.ndarray:
    """V^T [channel, token] from an SW64 buffer, tokens in their natural order (undoing pv_k_pos)."""
    return np.array([[dst[sw64(c, 16 * (t // 16) + pv_k_pos(t % 16, paired))] for t in range(64)] for c in range(64)],
                    np.uint8)


def as_k(src: np.ndarray) -> np.ndarray:
    return np.array([[src[sw64(t, c)] for c in range(64)] for t in range(64)], np.uint8)


def compare(seed: int = 0, nvalid_list=(64, 37, 1)) -> dict:
    """Every form (prmt, its options, and the ldmatrix form with uniform selectors for contrast) on one random SW64
    block at each valid-token count: exact against K^T (tokens past nvalid zero), and their per-warp instruction and
    wavefront counts for one 64 x 64 block."""
    src = np.random.default_rng(seed).integers(1, 256, size=64 * 64, dtype=np.uint8)  # never zero
    want_full = as_k(src).T
    rec: dict = {"exact": {}, "per_warp_per_block": {}}
    for nvalid in nvalid_list:
        want = want_full.copy()
        want[:, nvalid:] = 0
        for name, fn, paired in (
                ("prmt", prmt_form, False), ("prmt_swizzled_stores", lambda s, n: prmt_form(s, n, True), False),
                ("ldsm_stsm", ldsm_stsm, False),
                ("ldsm_stsm_uniform_selectors", lambda s, n: ldsm_stsm(s, n, lane_selectors=False), False),
                ("ldsm_stsm_paired", lambda s, n: ldsm_stsm(s, n, paired=True), True)):
            got, stats = fn(src, nvalid)
            rec["exact"][f"{name}@{nvalid}"] = bool(np.array_equal(as_vt(got, paired), want))
            rec["per_warp_per_block"][name] = stats
    for s in rec["per_warp_per_block"].values():
        s["instructions_per_thread"] = sum(v for k, v in s.items() if not k.startswith("wavefronts"))
    return rec


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", help="write the record here")
    args = ap.parse_args(argv)
    rec = compare()
    print(json.dumps(rec, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rec, f, indent=1)
    return 0 if all(rec["exact"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
