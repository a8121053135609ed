"""Test-suite wiring: `gpu`-marked tests are skipped unless a Hopper-class CUDA GPU is visible; on the device run
(scripts/gpu_check.sh sets SGLANG_H20_EXPECT_GPU=1) a GPU the guard cannot see stops the run instead, since every GPU
test would otherwise "pass" as skipped.

Without an NVIDIA device, Triton kernels run on its CPU interpreter: TRITON_INTERPRET must be set
before anything imports triton, so it is set here, first.
"""
import os

if "TRITON_INTERPRET" not in os.environ and not os.path.exists("/dev/nvidia0"):
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    from sglang_h20 import compat

    ok, why = compat.check_gpu()
    if ok:
        return
    if os.environ.get("SGLANG_H20_EXPECT_GPU") == "1":
        raise pytest.UsageError(f"SGLANG_H20_EXPECT_GPU=1 but {why}: every gpu test would be skipped")
    skip = pytest.mark.skip(reason=f"gpu test: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_user_tables(tmp_path_factory, monkeypatch):
    """Tables re-tuned on this machine (~/.cache/sglang_h20) take precedence over the shipped ones; the
    tests read the shipped ones, wherever they run."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg_cache")))
    from sgl_kernel_ext import gemm_table

    gemm_table.forget_tables()  # tables written by one test are looked at again in the next


@pytest.fixture
def no_gemm_table(monkeypatch, tmp_path):
    """No grouped-GEMM table, shipped or re-tuned, may change which variant a test exercises: the loader is pointed
    at a missing file, so the kernels' own heuristic choice runs (`pytestmark = pytest.mark.usefixtures(...)`)."""
    monkeypatch.setenv("SGLANG_H20_GEMM_TABLE", str(tmp_path / "absent.json"))
