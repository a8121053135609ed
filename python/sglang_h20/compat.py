"""What this process runs on: sglang/torch versions, the GPU, importable kernel modules, hook targets.

Each check answers (ok, reason) so that `doctor` and the plugin give the same verdict in the
same words. Nothing here raises on a missing GPU or package: a CPU-only machine is a valid answer.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata as md
import pkgutil

TESTED_SGLANG = "0.5.17"
TESTED_TORCH = "2.11.0"
MIN_CAPABILITY = (9, 0)  # Hopper: wgmma, FP8 tensor cores


def version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]
    memory_gib: float

    @property
    def label(self) -> str:
        return f"{self.name} (sm_{self.capability[0]}{self.capability[1]}, {self.memory_gib:.0f} GiB)"


@functools.lru_cache(maxsize=1)
def gpu() -> Gpu | None:
    """The first visible CUDA device, or None (no torch, no driver, no device)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        p = torch.cuda.get_device_properties(0)
        return Gpu(p.name, (p.major, p.minor), p.total_memory / 2**30)
    except Exception:  # a broken driver is "no GPU" for our purposes
        return None


def check_sglang() -> tuple[bool, str]:
    v = version("sglang")
    if v is None:
        return False, "sglang is not installed"
    if v != TESTED_SGLANG:
        return False, f"sglang {v} is untested (tested: {TESTED_SGLANG}); set SGLANG_H20_ALLOW_UNTESTED=1 to try"
    return True, f"sglang {v}"


def check_gpu() -> tuple[bool, str]:
    g = gpu()
    if g is None:
        return False, "no CUDA GPU visible"
    if g.capability < MIN_CAPABILITY:
        return False, f"{g.label} is older than sm_90 (Hopper)"
    return True, g.label


@functools.lru_cache(maxsize=None)
def check_import(module: str) -> tuple[bool, str]:
    try:
        importlib.import_module(module)
        return True, f"{module} imports"
    except Exception as e:  # ImportError, or a CUDA library failing to load
        return False, f"{module} does not import ({type(e).__name__}: {str(e).splitlines()[0][:120]})"


def check_target(target: str) -> tuple[bool, str]:
    """Resolve a dotted hook target the way SGLang's HookRegistry will."""
    obj_path, _, attr = target.rpartition(".")
    try:
        obj = pkgutil.resolve_name(obj_path)
    except Exception as e:
        return False, f"hook target {target}: {obj_path} does not resolve ({type(e).__name__}: {e})"
    if not hasattr(obj, attr):
        return False, f"hook target {target}: {obj_path} has no attribute {attr!r}"
    return True, target
