"""What the CPU tests of our CUDA sources share: finding the CUDA tools."""
from __future__ import annotations

import os
import shutil
from pathlib import Path


def cuobjdump() -> str | None:
    """cuobjdump from PATH, $CUDA_HOME/bin or the one Triton ships (for SASS without a GPU); None if none."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    cands = [Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "cuobjdump"]
    try:
        import triton
        cands.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    except ImportError:
        pass
    return next((str(c) for c in cands if c.is_file()), None)
