"""Our CUDA sources (csrc/*.cu) compiled with nvcc into shared libraries that ctypes loads: once per source, headers,
flags and nvcc (a content hash names the cached library), built on the GPU host at first use."""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

NVCC_FLAGS = ("-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "-shared", "-Xcompiler",
              "-fPIC,-fvisibility=hidden")  # hidden: libraries loaded side by side share no symbol


def device_problem() -> str | None:
    """Why our sm_90a kernels cannot run on this process's GPU (none, or not Hopper), or None when they can."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return f"needs sm_90 (Hopper), device is sm_{cap[0]}{cap[1]}"
    return None


def find_nvcc() -> str | None:
    for cand in (os.environ.get("SGLANG_H20_NVCC"), shutil.which("nvcc"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"), "/usr/local/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def open_library(path: Path, entry: str, argtypes) -> ctypes.CDLL:
    """A built library with its calling convention typed: `entry` launches and returns an error code, and
    `entry`_error_string turns that code into text (every kernel library here follows it)."""
    lib = ctypes.CDLL(str(path))
    launch, explain = getattr(lib, entry), getattr(lib, entry + "_error_string")
    launch.restype, launch.argtypes = ctypes.c_int, argtypes
    explain.restype, explain.argtypes = ctypes.c_char_p, [ctypes.c_int]
    return lib


def compile_library(src: Path, flags, nvcc: str | None, verbose: bool = True) -> Path:
    """`src` built with `flags` by `nvcc` (find_nvcc()'s; None: RuntimeError saying where it was looked for) -> the
    library's path in $SGLANG_H20_CACHE (default ~/.cache/sglang_h20); the key hashes the source, every header beside
    it, the flags and nvcc's path, so an edit rebuilds."""
    if nvcc is None:
        raise RuntimeError("nvcc not found (PATH, $CUDA_HOME/bin, or set SGLANG_H20_NVCC)")
    flags = list(flags)
    text = src.read_bytes() + b"".join(h.read_bytes() for h in sorted(src.parent.glob("*.cuh")))
    key = hashlib.sha256(text + "\0".join(flags).encode() + nvcc.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("SGLANG_H20_CACHE", Path.home() / ".cache" / "sglang_h20"))
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / f"{src.stem}_{key}.so"
    if out.is_file():
        return out
    if verbose:
        dflags = "".join(f" {f}" for f in flags if f.startswith("-D"))
        print(f"[sgl_kernel_ext] compiling {src.name}{dflags} with {nvcc} (once, ~10 s) ...", file=sys.stderr,
              flush=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    cmd = [nvcc, *flags, str(src), "-o", tmp]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{res.stdout}\n{res.stderr}")
    os.replace(tmp, out)  # atomic: concurrent builders each write their own temp file
    if verbose:
        print(f"[sgl_kernel_ext] built {out}", file=sys.stderr, flush=True)
    return out
