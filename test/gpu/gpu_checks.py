"""What a GPU test does when one of our CUDA kernels is unavailable: skip where it cannot run at all (no GPU, not
Hopper), fail on a Hopper GPU, so that a build error on the device shows as a failure and not as a passing skip."""
from __future__ import annotations

import pytest


def need_cuda_kernel(ok: bool, why: str, what: str) -> None:
    """`ok, why` from a kernel module's available(); `what` names the kernel in the message."""
    if ok:
        return
    from sgl_kernel_ext import cuda_build

    problem = cuda_build.device_problem()
    if problem:
        pytest.skip(f"{what}: {problem}")
    pytest.fail(f"{what} unavailable on this Hopper GPU: {why}", pytrace=False)
