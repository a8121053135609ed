"""The hand-written FP8 grouped GEMM (csrc/grouped_gemm_fp8_sm90.cu): the normal variant (tokens on the wgmma's M
side; tile forms FORMS) with a TMA producer warp group beside two math warp groups, which Triton's warp-specialized
loop could not give us on the H200 (config `ws` hangs). Same operands and results as grouped_gemm_fp8's contiguous
and masked layouts; built with nvcc at first use (cuda_build), sm_90 only. Opt-in (the bench's `ours-cuda`): no
table routes to it until it is measured faster.

    out = m_grouped_fp8_gemm_nt_cuda(a, a_scale, b, b_scale, m_indptr=indptr)    # contiguous
    out = m_grouped_fp8_gemm_nt_cuda(a, a_scale, b, b_scale, masked_m=counts)    # masked
    out = m_grouped_fp8_gemm_nt_cuda(..., form="64x256-pd")                       # another tile form (FORMS)

ABLATIONS are compile-time switches that each remove one part of the kernel's work (results wrong by design; the
.cu's header says what each removes): `defines=("GG_ABLATE_NO_LOAD",)` builds and runs that library instead
(benchmark/kernels/grouped_gemm_cuda_ablation.py times them).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from .cuda_build import NVCC_FLAGS, compile_library, device_problem, find_nvcc, open_library

SOURCE = Path(__file__).resolve().parent / "csrc" / "grouped_gemm_fp8_sm90.cu"
BLOCK = 128  # K must be a multiple of it (the scale block), N of the form's columns
MAX_GROUPS = 1024  # the kernel's per-CTA tile table
# the kernel's tile forms, by its `form` index (csrc header): token rows x weight columns; d: the scratch
# accumulator double-buffered (K block kb + 1's wgmmas issued before kb's promotion); s: the block scales staged in
# shared memory by a loader warp; m: two CTAs of a cluster on adjacent column blocks share the token tile (TMA
# multicast); b: two CTAs on adjacent row blocks share the weight tile (DeepGEMM's configuration at 256 tokens per
# expert; an odd last row block pairs with an empty one). 128x192: N need only be a multiple of 128 (a partial last
# column block).
FORMS = ("64x256-pd", "128x128-ds", "128x192-s", "128x192-sm", "128x192-sb")
DEFAULT_FORM = "128x128-ds"  # the fastest of ours at 128-256 tokens per expert (session 45)
ABLATIONS = ("GG_ABLATE_NO_LOAD", "GG_ABLATE_NO_MMA")
_ARGTYPES = ([ctypes.c_void_p] * 2 + [ctypes.c_longlong] * 3 + [ctypes.c_void_p] * 5 + [ctypes.c_longlong]
             + [ctypes.c_int] * 6 + [ctypes.c_void_p])
_libs: dict[tuple[str, ...], ctypes.CDLL] = {}  # by defines (() the normal build)
_lib_error: str | None = None


def _load(defines: tuple[str, ...] = ()) -> ctypes.CDLL:
    bad = sorted(set(defines) - set(ABLATIONS))
    if bad:
        raise ValueError(f"unknown defines {bad} (have {', '.join(ABLATIONS)})")
    key = tuple(sorted(set(defines)))
    if key not in _libs:
        flags = (*NVCC_FLAGS, *(f"-D{d}" for d in key))
        _libs[key] = open_library(compile_library(SOURCE, flags, find_nvcc()), "grouped_gemm_fp8_sm90", _ARGTYPES)
    return _libs[key]


def available() -> tuple[bool, str]:
    """(True, "") when the kernel can run here: an sm_90 GPU, nvcc, a build."""
    global _lib_error
    problem = device_problem()
    if problem:
        return False, problem
    if _lib_error is None:
        try:
            _load()
            _lib_error = ""
        except (RuntimeError, OSError) as e:
            _lib_error = f"build/load failed: {e}"
    return not _lib_error, _lib_error


def tile_shape(form: str) -> tuple[int, int]:
    """(token rows, weight columns) of a tile form."""
    if form not in FORMS:
        raise ValueError(f"unknown form {form!r} (have {', '.join(FORMS)})")
    rows, cols = form.split("-")[0].split("x")
    return int(rows), int(cols)


def _check(a, a_scale, b, b_scale, form: str) -> None:
    groups, n, k = b.shape
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        raise ValueError(f"a and b must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    if n % BLOCK or k % BLOCK or a.shape[-1] != k:
        raise ValueError(f"need N and K multiples of {BLOCK} and a's K = b's: a {tuple(a.shape)}, b {tuple(b.shape)}")
    cols = tile_shape(form)[1]
    if cols % BLOCK == 0 and n % cols:  # 128x192's last column block may be partial
        raise ValueError(f"form {form} needs N a multiple of {cols}, got {n}")
    if form.endswith("m") and -(-n // cols) % 2:  # multicast: the clusters take pairs of column blocks
        raise ValueError(f"form {form} needs an even number of column blocks of {cols}, got N {n}")
    if not 0 < groups <= MAX_GROUPS:
        raise ValueError(f"groups must be 1..{MAX_GROUPS}, got {groups}")
    if tuple(a_scale.shape[:-1]) != tuple(a.shape[:-1]) or a_scale.shape[-1] != k // BLOCK:
        raise ValueError(f"a_scale must be {(*a.shape[:-1], k // BLOCK)}, got {tuple(a_scale.shape)}")
    if tuple(b_scale.shape) != (groups, n // BLOCK, k // BLOCK):
        raise ValueError(f"b_scale must be {(groups, n // BLOCK, k // BLOCK)}, got {tuple(b_scale.shape)}")
    for name, t in (("a", a), ("b", b), ("b_scale", b_scale)):  # a_scale: any strides (row- or MN-major)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if a_scale.dtype != torch.float32 or b_scale.dtype != torch.float32:
        raise ValueError("a_scale and b_scale must be float32")


def mn_major(scale: torch.Tensor) -> torch.Tensor:
    """The same activation scales with the rows contiguous per K block (DeepGEMM's layout, unpadded). The staged forms
    then read a tile's row scales in 16 sectors per K block, not 128; session 45 timed no difference."""
    return scale.transpose(-1, -2).contiguous().transpose(-1, -2)


def m_grouped_fp8_gemm_nt_cuda(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                               m_indptr: torch.Tensor | None = None, masked_m: torch.Tensor | None = None,
                               out: torch.Tensor | None = None, num_sms: int | None = None,
                               form: str = DEFAULT_FORM, defines: tuple[str, ...] = ()) -> torch.Tensor:
    """out[r] = A[r] @ B[g]^T (bf16) over expert g's rows: contiguous (m_indptr [G+1] int32; a [M, K], a_scale
    [M, K/128]) or masked (masked_m [G] int32; a [G, max_m, K], a_scale [G, max_m, K/128]); b [G, N, K] e4m3,
    b_scale [G, N/128, K/128]. a_scale may have any strides: row-major as our Triton kernels take it, or MN-major
    as DeepGEMM takes it (mn_major). Rows of no expert are left as they were; num_sms: the grid (default: the
    device's); form: the tile form (FORMS); defines: ABLATIONS to build in (wrong results by design)."""
    if (m_indptr is None) == (masked_m is None):
        raise ValueError("give exactly one of m_indptr (contiguous) and masked_m (masked)")
    groups, n, k = b.shape
    index = m_indptr if m_indptr is not None else masked_m
    want = groups + 1 if m_indptr is not None else groups
    if index.dtype != torch.int32 or tuple(index.shape) != (want,) or not index.is_contiguous():
        raise ValueError(f"{'m_indptr' if m_indptr is not None else 'masked_m'} must be contiguous int32 [{want}]")
    if masked_m is not None and (a.dim() != 3 or a.shape[0] != groups):
        raise ValueError(f"masked a must be [{groups}, max_m, K], got {tuple(a.shape)}")
    if m_indptr is not None and a.dim() != 2:
        raise ValueError(f"contiguous a must be [M, K], got {tuple(a.shape)}")
    _check(a, a_scale, b, b_scale, form)
    rows = a.numel() // k
    if out is None:
        out = torch.empty(*a.shape[:-1], n, dtype=torch.bfloat16, device=a.device)
    elif out.shape != (*a.shape[:-1], n) or out.dtype != torch.bfloat16 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous bf16 {(*a.shape[:-1], n)}")
    if rows == 0:
        return out
    max_m = a.shape[1] if masked_m is not None else 0
    sms = num_sms or torch.cuda.get_device_properties(a.device).multi_processor_count
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    sa_strides = a_scale.stride() if masked_m is not None else (0, *a_scale.stride())
    lib = _load(tuple(defines))
    err = lib.grouped_gemm_fp8_sm90(ptr(a), ptr(a_scale), *sa_strides, ptr(b), ptr(b_scale), ptr(out),
                                    ptr(m_indptr), ptr(masked_m), rows, groups, max_m, n, k, sms,
                                    FORMS.index(form), torch.cuda.current_stream(a.device).cuda_stream)
    if err:
        raise RuntimeError(f"grouped_gemm_fp8_sm90: {lib.grouped_gemm_fp8_sm90_error_string(err).decode()}")
    return out
