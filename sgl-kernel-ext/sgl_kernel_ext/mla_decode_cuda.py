"""FP8 MLA decode with a CUDA C++ split kernel (sm_90a, FP8 wgmma for both QK^T and PV).

Same interface and result as :func:`sgl_kernel_ext.mla_decode.mla_decode_fp8`; only the split kernel differs
(``sgl_kernel_ext/csrc/mla_fp8_decode_sm90.cu``, design in its header comment). The Q pre-pass, the launch plan
(:func:`get_mla_decode_metadata`) and the split-KV combine kernel are the Triton ones from ``mla_decode``.

Three versions of the split kernel, same launcher signature and results (``version=`` of :func:`build`,
:func:`available`, :func:`mla_decode_fp8_cuda`):

- 1 (default): ``mla_fp8_decode_sm90.cu``, two warpgroups in lockstep (measured on the H200, 45 GPU tests).
- 2: ``mla_fp8_decode_sm90_v2.cu``, warp-specialized "seesaw": the two math warpgroups own alternate KV tiles for
  QK^T + softmax (independent softmax chains merged per tile) while a loader warpgroup streams K tiles, so one
  warpgroup's softmax overlaps the other's tensor-core work (v1 leaves the tensor cores idle for most of each tile).
  Exists because v1 runs at 0.47-0.66x FlashMLA BF16; measured on the H200 (2026-11-30) it is only 1.00-1.10x v1.
- 3: ``mla_fp8_decode_sm90_v3.cu``, built for few query rows (16 heads x q_len 1-2): the KV tile's 64 tokens on
  wgmma's M side and the query rows on N (m64n16/n32), V^T as a register operand built by ldmatrix.trans, so a
  16-head step does 16 rows' tensor work instead of 64 and no V transpose passes through shared memory. More rows
  run as blocks of 32 (:func:`cta_rows`; 128 heads: 4 CTAs per sequence and split, each streaming the same K
  tiles: 1.16-1.49x version 2's time at 128 heads on the H200); the backend's 'auto' runs it up to
  :data:`V3_MAX_ROWS` rows, where it was measured fastest.

The ``.cu`` is compiled on first use with nvcc into a shared library (no torch headers: a few seconds) cached
under ``~/.cache/sglang_h20/`` keyed by a hash of the source, the shared header and the flags (``-D`` defines
included), and called through ctypes on torch's current stream, so it can be captured in a CUDA graph.

Ablation builds, for finding where the time goes (benchmark/kernels/mla_cuda_ablation.py): ``defines=`` of
:func:`build`, :func:`available` and :func:`mla_decode_fp8_cuda` adds ``-D`` flags, e.g. ``("MLA_ABLATE_NO_PV",)``;
:data:`ABLATIONS` lists the switches (the v2 ``.cu``'s header says what each removes). Their results are wrong by
design. :data:`DESIGN_OPTIONS` are defines that change only how the kernel works: bit-identical results (a GPU test
checks it), or for :data:`REORDERING_OPTIONS` the same sums in another order and for :data:`ROUNDING_OPTIONS` other
fp32 roundings; timed against the default before one replaces it. The defines are part of the library's cache key;
the default ``()`` is the normal build.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import re
from pathlib import Path

import torch

from . import mla_decode as _triton_mla
from .cuda_build import NVCC_FLAGS, compile_library, device_problem, open_library
from .cuda_build import find_nvcc as _find_nvcc  # module attribute: the tests fake it
from .hostmath import cdiv
from .mla_decode import (
    HEAD_DIM_QK, KV_LORA_RANK, LOG2E, NUM_KV_SCALES, MLADecodeMetadata, _cache_views, _quantize_q, decode_args,
)

__all__ = ["build", "available", "library", "mla_decode_fp8_cuda", "get_mla_decode_metadata", "planners",
           "source_path", "NVCC_FLAGS", "VERSIONS", "GENERAL_VERSIONS", "V3_MAX_ROWS", "cta_rows", "ABLATIONS",
           "DESIGN_OPTIONS", "REORDERING_OPTIONS", "ROUNDING_OPTIONS"]

PAGE_SIZE = 64   # the kernel's KV tile is one page
ROWS_PER_CTA = 64  # query rows (q position x head) per CTA
CTAS_PER_SM = 1  # both versions fill the register file (v1 255 regs x 256 threads, v2 168 x 384)
SPLIT_COST_TILES = 2.0  # a split CTA's extra cost in KV tiles: its fp32 partials (128 KB) out, and the combine
MIN_SPLIT_TILES = 2  # no split shorter than 128 tokens
ENTRY_POINTS = ("mla_fp8_decode_sm90", "mla_fp8_decode_sm90_error_string", "mla_fp8_decode_sm90_smem_bytes")

VERSIONS = (1, 2, 3)
GENERAL_VERSIONS = (1, 2)  # any row count; also the versions with the -DMLA_ABLATE_* switches and DESIGN_OPTIONS
V3_MAX_ROWS = 32  # the backend's 'auto' runs version 3 up to this many query rows (heads x q_len): one CTA, N 16/32
_SOURCES = {1: ("SGLANG_H20_MLA_CU", "mla_fp8_decode_sm90.cu"),
            2: ("SGLANG_H20_MLA_CU_V2", "mla_fp8_decode_sm90_v2.cu"),
            3: ("SGLANG_H20_MLA_CU_V3", "mla_fp8_decode_sm90_v3.cu")}
# compile-time switches of both versions, each removing one part of the split kernel's work (results wrong)
ABLATIONS = ("MLA_ABLATE_NO_TRANSPOSE", "MLA_ABLATE_NO_SOFTMAX", "MLA_ABLATE_NO_PV", "MLA_ABLATE_NO_QK",
             "MLA_ABLATE_NO_LOAD", "MLA_ABLATE_NO_MERGE", "MLA_ABLATE_EMPTY")
# design options: -D macros that change how the kernels work, not what they compute (bit-identical results, or the
# same sums in another order for REORDERING_OPTIONS, other fp32 roundings for ROUNDING_OPTIONS; the GPU test checks
# it), timed against the default build by mla_cuda_ablation.py before one becomes the default
# (csrc/mla_fp8_sm90_common.cuh). The first three are the V^T forms the default (ldmatrix + stmatrix.trans, tokens
# l and l + 8 paired in P' and V^T) replaced in session 27:
# 8-byte loads + prmt + 8-byte stores (the earlier default), the same with conflict-free stores, and ldmatrix with
# tokens 2l, 2l + 1 paired; they sum P'V in the other k order. MLA_CP_ASYNC_LOAD (version 2; v1 always loads so):
# the loader warpgroup fetches K tiles by 16-byte cp.async, the loader TMA boxes replaced in session 28.
# MLA_EAGER_RESCALE (version 2): O rescaled to the running maxima on every tile, the merge that lazy rescaling (O
# rescaled only when a tile's maxima run far above its reference) replaced in session 28; the same arithmetic up to
# fp32 rounding.
# MLA_PREPASS_Q (version 2): Q quantized by the Triton pre-pass (a launch of its own), which the split kernel's own
# quantization (bf16 rows in) replaced in session 29.
# MLA_SPLIT_Q (versions 2 and 3; session 31, measured and made the backend's default in session 32): Q may come as two
# tensors, the 512 latent and the 64 rope channels (mla_decode_fp8_cuda's q_rope=), read at their own strides: no
# joined copy of Q.
# (Two more, MLA_RUNTIME_DIRECT and MLA_BF16_PARTIALS of session 32, were 0.955-1.00x the default build on the H200
# in session 33 and were removed in session 38; the default builds' cubins were byte-identical before and after.)
# (Session 46's MLA_FULL_TILES and MLA_LOADER_SLEEP, from v2's per-instruction profile: 13% fewer executed
# instructions, 0.99-1.02x the default build's time; removed, benchmark/results/mla_decode/README.md session 46.)
# (Session 46's MLA_UNIFORM_WG, version 1's warpgroup index through a shuffle: 0.99-1.00x the default build at batch
# 1-8 on the H200 in session 48, bit-identical; removed.)
DESIGN_OPTIONS = ("MLA_VT_PRMT", "MLA_VT_STORE_SWIZZLE", "MLA_VT_LDSM", "MLA_CP_ASYNC_LOAD", "MLA_EAGER_RESCALE",
                  "MLA_PREPASS_Q", "MLA_SPLIT_Q")
REORDERING_OPTIONS = DESIGN_OPTIONS[:3]  # close to the default build's results, not bit-identical
ROUNDING_OPTIONS = ("MLA_EAGER_RESCALE",)  # likewise close: another rounding than the default's
_libs: dict[tuple[int, tuple[str, ...]], ctypes.CDLL] = {}  # (version, defines)
_lib_errors: dict[tuple[int, tuple[str, ...]], str] = {}
_POISON_WORKSPACE = False  # tests: split partials start as NaN, so a partial read but never written shows up


def _check_version(version: int) -> int:
    if version not in VERSIONS:
        raise ValueError(f"unknown MLA CUDA kernel version {version!r} (have {VERSIONS})")
    return version


def _check_defines(defines) -> tuple[str, ...]:
    """Sorted and deduplicated (one library per set, whatever the order); NAME or NAME=VALUE only."""
    if isinstance(defines, str):
        defines = (defines,)
    out = tuple(sorted(set(defines)))
    for d in out:
        if not re.fullmatch(r"[A-Za-z_]\w*(=[\w.+-]*)?", d):
            raise ValueError(f"bad define {d!r} (want NAME or NAME=VALUE)")
    return out


def source_path(version: int = 1) -> Path:
    """The kernel source: env SGLANG_H20_MLA_CU (version 1) / SGLANG_H20_MLA_CU_V2 / _V3, else the package's
    csrc/ (installed with it as package data)."""
    env_name, fname = _SOURCES[_check_version(version)]
    env = os.environ.get(env_name)
    if env:
        return Path(env)
    return Path(__file__).resolve().parent / "csrc" / fname


def build(verbose: bool = True, version: int = 1, defines=()) -> Path:
    """Compile the .cu of `version` (once per source/flags hash) and return the shared library's path; `defines`:
    extra -D macros (the ablation builds)."""
    defines = _check_defines(defines)
    src = source_path(version)
    if not src.is_file():
        raise RuntimeError(f"MLA CUDA kernel source not found at {src} (set {_SOURCES[version][0]})")
    return compile_library(src, [*NVCC_FLAGS, *(f"-D{d}" for d in defines)], _find_nvcc(), verbose)


# mla_fp8_decode_sm90's C signature (csrc/mla_fp8_sm90_common.cuh, MLA_FP8_DEFINE_ENTRY_POINTS), for ctypes:
# 10 pointers (q8, qs, kv, kvs, block_table, seqlens, out, lse, op, lp), 13 strides, the cache's page count (v2's
# TMA tensor map), batch, heads, q_len, num_splits, the run-time split count pointer (nullable),
# causal, qk_scale, Q's rope part (nullable) and the two parts' strides, stream
LAUNCH_ARGTYPES = ([ctypes.c_void_p] * 10 + [ctypes.c_longlong] * 14 + [ctypes.c_int] * 4 + [ctypes.c_void_p]
                   + [ctypes.c_int, ctypes.c_float, ctypes.c_void_p] + [ctypes.c_longlong] * 4 + [ctypes.c_void_p])


def launch_args(q8, qs, kv_data, kv_scales, block_table, cache_seqlens, direct_out, lse, op, lp, metadata, causal,
                softmax_scale, stream, split_q=None) -> tuple:
    """mla_fp8_decode_sm90's arguments, in LAUNCH_ARGTYPES order (op/lp None: one split, bf16 out written
    directly). The split-count pointer is null unless metadata.splits_dev is set and the launch splits. split_q (an
    MLA_SPLIT_Q build, see split_q_strides): (q_rope, the latent part's byte strides by sequence and head, the rope
    part's); q8 is then the latent part."""
    direct = op is None
    sop = (0, 0, 0) if direct else (op.stride(0), op.stride(1), op.stride(2))
    slp = (0, 0) if direct else (lp.stride(0), lp.stride(1))
    B, q_len, H, _ = direct_out.shape
    return (_ptr(q8), _ptr(qs), _ptr(kv_data), _ptr(kv_scales), _ptr(block_table), _ptr(cache_seqlens),
            _ptr(direct_out) if direct else 0, _ptr(lse) if direct else 0, _ptr(op), _ptr(lp),
            kv_data.stride(0), kv_scales.stride(0), block_table.stride(0),
            *direct_out.stride()[:3], *lse.stride()[:2], *sop, *slp, kv_data.shape[0],
            B, H, q_len, metadata.num_splits, 0 if direct else _ptr(metadata.splits_dev),
            int(bool(causal)), float(softmax_scale) * LOG2E,
            *((_ptr(split_q[0]), *split_q[1:]) if split_q is not None else (0, 0, 0, 0, 0)), stream)


def split_q_strides(q: torch.Tensor, q_rope: torch.Tensor, version: int, defines) -> tuple | None:
    """(q_rope, latent sequence/head byte strides, rope ones) when an MLA_SPLIT_Q build of version 2 or 3 can read the
    two parts of Q where they are (q [B, 1, H, 512], q_rope [B, 1, H, 64], bf16, channels contiguous, every row
    16-byte aligned: the kernel loads 16 bytes at a time); None when the caller must join them."""
    if (version not in (2, 3) or "MLA_SPLIT_Q" not in defines or "MLA_PREPASS_Q" in defines or q.shape[1] != 1
            or q.dtype != torch.bfloat16 or q_rope.dtype != torch.bfloat16):
        return None
    strides = []
    for t in (q, q_rope):
        if t.stride(3) != 1 or t.data_ptr() % 16:
            return None
        sb, sh = t.stride(0) * 2, t.stride(2) * 2  # bytes
        if sb % 16 or sh % 16:
            return None
        strides += [sb, sh]
    return (q_rope, *strides)


def _load(version: int = 1, defines=()):
    key = (_check_version(version), _check_defines(defines))
    lib = _libs.get(key)
    if lib is not None:
        return lib
    lib = open_library(build(version=version, defines=key[1]), "mla_fp8_decode_sm90", LAUNCH_ARGTYPES)
    _libs[key] = lib
    return lib


def library(version: int = 1, defines=()) -> ctypes.CDLL:
    """The loaded library of kernel `version` built with `defines`, for entry points beyond the launch: e.g. the
    -DMLA_TRACE build's mla_fp8_trace_reset / _read / _shape (csrc/mla_fp8_trace.cuh, trace_mla_decode.py)."""
    return _load(version, defines)


def available(version: int = 1, defines=()) -> tuple[bool, str]:
    """(True, "") when kernel `version` (built with `defines`) can run here: a CUDA GPU of compute capability 9.0,
    nvcc, the source, a build."""
    key = (_check_version(version), _check_defines(defines))
    problem = device_problem()
    if problem:
        return False, problem
    if key in _lib_errors:
        return False, _lib_errors[key]
    try:
        _load(*key)
    except (RuntimeError, OSError) as e:
        _lib_errors[key] = f"build/load failed: {e}"
        return False, _lib_errors[key]
    return True, ""


def cta_rows(version: int, rows: int) -> int:
    """Query rows per CTA of a split kernel for a call of `rows` rows per sequence: 64 (versions 1 and 2); version 3:
    16 up to 16 rows, else 32 (its wgmma N)."""
    if version == 3:
        return 16 if rows <= 16 else 32
    return ROWS_PER_CTA


def split_cost(programs, tiles, splits, num_sm: int):
    """Modelled time of one launch in KV-tile units: waves of CTAs (one per SM) x tiles per CTA, plus a split's
    fixed cost. The wave count is what the Triton kernel's plan (2 waves' worth of programs) gets wrong for a
    kernel with one CTA per SM: 288 CTAs on 132 SMs run as 3 waves, the last one a sixth full. Plain integer
    arithmetic, so tiles and splits may also be broadcasting int64 tensors (splits_lut: every pair at once)."""
    slots = num_sm * CTAS_PER_SM
    waves = (programs * splits + slots - 1) // slots
    return waves * ((tiles + splits - 1) // splits + SPLIT_COST_TILES * (splits > 1))


def get_mla_decode_metadata(cache_seqlens: torch.Tensor, num_heads: int, q_len: int = 1, num_sm: int | None = None,
                            *, max_seqlen: int | None = None, max_splits: int = 64,
                            rows_per_cta: int = ROWS_PER_CTA) -> MLADecodeMetadata:
    """The CUDA kernels' launch plan (FlashMLA's name for it): the split count minimizing split_cost over
    1 .. max_splits, splits of at least MIN_SPLIT_TILES tiles, ties to fewer splits. E.g. 132 SMs, 128 heads,
    4k tokens: batch 64 -> 1 split (Triton's plan: 3), batch 16 -> 4 (Triton's: 9). max_seqlen: as in
    mla_decode.get_mla_decode_metadata (pass it on a hot path: no device sync). rows_per_cta: the kernel's
    (cta_rows), which sets the CTAs per sequence and split."""
    if max_seqlen is None:  # read once (a device sync), for the base plan too
        max_seqlen = int(cache_seqlens.max().item()) if cache_seqlens.numel() else 1
    base = _triton_mla.get_mla_decode_metadata(cache_seqlens, num_heads, q_len, num_sm, max_seqlen=max_seqlen,
                                               block_h=ROWS_PER_CTA, block_n=PAGE_SIZE)
    tiles = cdiv(max(int(max_seqlen), 1), PAGE_SIZE)
    row_blocks = cdiv(num_heads * q_len, rows_per_cta)
    programs = max(cache_seqlens.numel() * row_blocks, 1)
    top = max(1, min(max_splits, tiles // MIN_SPLIT_TILES))
    best = min(range(1, top + 1), key=lambda s: (split_cost(programs, tiles, s, base.num_sm), s))
    # the kernel's own row blocks, so that mla_decode.graph_metadata counts its CTAs per split
    return dataclasses.replace(base, num_splits=best, block_h=rows_per_cta, num_row_blocks=row_blocks)


def splits_lut(num_heads: int, q_len: int, batch: int, max_seqlen: int, page: int = PAGE_SIZE,
               num_sm: int | None = None, device=None, max_splits: int = 64,
               rows_per_cta: int = ROWS_PER_CTA) -> torch.Tensor:
    """get_mla_decode_metadata's split count for every longest length up to max_seqlen, in steps of a page:
    int32 [cdiv(max_seqlen, 64) + 1], entry t for a longest sequence of t pages (entry 0 = entry 1); the same
    cost model evaluated for all lengths and split counts at once (a CUDA graph's batch size gets one table at
    capture; mla_decode.set_splits picks the entry of each replay's lengths)."""
    assert page == PAGE_SIZE, f"the CUDA kernels' tile is one {PAGE_SIZE}-token page"
    base = _triton_mla.get_mla_decode_metadata(torch.ones(max(batch, 1), dtype=torch.int32), num_heads, q_len,
                                               num_sm, max_seqlen=PAGE_SIZE, block_h=ROWS_PER_CTA,
                                               block_n=PAGE_SIZE)
    programs = max(batch * cdiv(num_heads * q_len, rows_per_cta), 1)
    tiles = torch.arange(cdiv(max(int(max_seqlen), 1), PAGE_SIZE) + 1, dtype=torch.int64).clamp_(min=1)
    splits = torch.arange(1, max_splits + 1, dtype=torch.int64)
    cost = split_cost(programs, tiles[:, None], splits[None, :], base.num_sm)
    top = (tiles // MIN_SPLIT_TILES).clamp_(1, max_splits)
    cost = torch.where(splits[None, :] <= top[:, None], cost, float("inf"))
    return (torch.argmin(cost, dim=1) + 1).to(torch.int32).to(device or "cpu")  # first minimum: fewer splits


def planners(version) -> tuple:
    """(planner, split table) with get_mla_decode_metadata's and splits_lut's signatures, for calls run by `version`:
    an int, or version(batch, rows) -> int where the version depends on the call's shape (the backend's 'auto').
    Each plans for the CTAs of the version that runs (cta_rows: version 3 at 128 heads runs four 32-row CTAs per
    sequence, where versions 1 and 2 run two of 64, so a 64-row plan would count half its CTAs per split)."""
    version_of = version if callable(version) else (lambda batch, rows: version)

    def plan(cache_seqlens, num_heads, q_len=1, num_sm=None, **kwargs):
        rows = num_heads * q_len
        return get_mla_decode_metadata(cache_seqlens, num_heads, q_len, num_sm, **kwargs,
                                       rows_per_cta=cta_rows(version_of(cache_seqlens.numel(), rows), rows))

    def lut(num_heads, q_len, batch, max_seqlen, page=PAGE_SIZE, num_sm=None, device=None, **kwargs):
        rows = num_heads * q_len
        return splits_lut(num_heads, q_len, batch, max_seqlen, page, num_sm, device, **kwargs,
                          rows_per_cta=cta_rows(version_of(batch, rows), rows))
    return plan, lut


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def mla_decode_fp8_cuda(q: torch.Tensor, kv_cache, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
                        softmax_scale: float, metadata: MLADecodeMetadata | None = None, causal: bool = True,
                        return_lse: bool = False, out: torch.Tensor | None = None, version: int = 1, defines=(),
                        q_rope: torch.Tensor | None = None):
    """MLA decode over the FP8 paged cache (page size 64), as :func:`mla_decode_fp8`; `version` picks the split
    kernel (1, 2 or 3, see the module docstring), `defines` an ablation build of it (wrong results by design) or a
    design option (the same results). Versions 2 and 3 quantize Q themselves (a q of another dtype is rounded to bf16
    first) unless built with MLA_PREPASS_Q; version 1 gets it from the Triton pre-pass.

    q [B, q_len, H, 576], kv_cache = (kv_fp8 [P, 64, 576], kv_scales [P, 64, 2] fp32), block_table [B, max_pages]
    int32, cache_seqlens [B] int32. Uses metadata.num_splits (the kernel's own row blocks are cta_rows(version,
    rows)); without metadata, this module's get_mla_decode_metadata plans for them.
    Returns out [B, q_len, H, 512] (q's dtype; bf16 written by the kernel) and, with return_lse, lse [B, q_len, H].
    q_rope [B, q_len, H, 64]: Q in two parts, q then holding the 512 latent channels (SGLang's q_nope_out, q_pe);
    an MLA_SPLIT_Q build of version 2 or 3 reads them where they are (split_q_strides), any other joins them.
    """
    _check_version(version)
    defines = _check_defines(defines)
    split_q = None
    if q_rope is not None:
        assert q.shape[-1] == KV_LORA_RANK and q_rope.shape[:-1] == q.shape[:-1] and q_rope.shape[-1] == HEAD_DIM_QK - \
            KV_LORA_RANK, f"q {tuple(q.shape)} / q_rope {tuple(q_rope.shape)}: want [..., 512] and [..., 64]"
        split_q = split_q_strides(q, q_rope, version, defines)
        if split_q is None:
            q = torch.cat([q, q_rope.to(q.dtype)], dim=-1)
    kv_data, kv_scales = _cache_views(*kv_cache)
    B, q_len, H, D = q.shape
    D = HEAD_DIM_QK if split_q is not None else D
    assert D == HEAD_DIM_QK, f"q last dim must be {HEAD_DIM_QK}, got {D}"
    assert kv_data.shape[1] == PAGE_SIZE, f"the CUDA kernel needs page size {PAGE_SIZE}, got {kv_data.shape[1]}"
    assert kv_data.stride(2) == 1 and kv_data.stride(1) == HEAD_DIM_QK and kv_data.stride(0) % 16 == 0, \
        "kv_fp8 pages must hold 64 contiguous 576-byte tokens"
    assert kv_scales.stride(2) == 1 and kv_scales.stride(1) == NUM_KV_SCALES and kv_scales.stride(0) % 4 == 0, \
        "kv_scales pages must hold 64 contiguous (latent, rope) pairs"
    assert kv_data.data_ptr() % 16 == 0 and kv_scales.data_ptr() % 16 == 0
    assert q.is_cuda and kv_data.device == q.device
    if metadata is None:
        metadata = get_mla_decode_metadata(cache_seqlens, H, q_len, rows_per_cta=cta_rows(version, q_len * H))
    block_table, cache_seqlens, metadata, out, lse = decode_args(q, block_table, cache_seqlens, metadata, out)
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    cache_seqlens = cache_seqlens.contiguous()
    S = metadata.num_splits
    rows = q_len * H
    if B == 0:
        return (out, lse) if return_lse else out
    # the kernel writes bf16 with 4-byte stores; another dtype goes through a bf16 buffer
    direct_out = out if (out.dtype == torch.bfloat16 and all(s % 2 == 0 for s in out.stride()[:3])
                         and out.data_ptr() % 4 == 0) else torch.empty(out.shape, dtype=torch.bfloat16,
                                                                         device=q.device)
    direct = S == 1
    _triton_mla.splits_pointer(metadata, cache_seqlens)  # splits_dev, if set: int32 [1] on q's device
    op = lp = None
    if not direct:
        op = torch.empty((B, rows, S, KV_LORA_RANK), dtype=torch.float32, device=q.device)
        lp = torch.empty((B, rows, S), dtype=torch.float32, device=q.device)
        if _POISON_WORKSPACE:
            op.fill_(float("nan"))
            lp.fill_(float("nan"))

    if split_q is not None:  # the kernel reads both parts where they are
        q8, qs = q, None
    elif version in (2, 3) and "MLA_PREPASS_Q" not in defines:  # the kernel quantizes the bf16 rows itself
        q8, qs = q.to(torch.bfloat16).reshape(-1, HEAD_DIM_QK).contiguous(), None
    else:
        q8, qs = _quantize_q(q)
    lib = _load(version, defines)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    with torch.cuda.device(q.device):
        err = lib.mla_fp8_decode_sm90(*launch_args(q8, qs, kv_data, kv_scales, block_table, cache_seqlens,
                                                   direct_out, lse, op, lp, metadata, causal, softmax_scale, stream,
                                                   split_q))
    if err != 0:
        msg = lib.mla_fp8_decode_sm90_error_string(err).decode()
        raise RuntimeError(f"mla_fp8_decode_sm90 launch failed: {msg} (cudaError {err})")
    if direct:
        if direct_out is not out:
            out.copy_(direct_out)
    else:
        _triton_mla.combine_partials(op, lp, cache_seqlens, out, lse, metadata, PAGE_SIZE)
    return (out, lse) if return_lse else out
