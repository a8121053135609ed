"""Test-suite wiring: `gpu`-marked tests are skipped unless a Hopper-class CUDA GPU is visible."""
import pytest


def pytest_collection_modifyitems(config, items):
    from sglang_h20 import compat

    ok, why = compat.check_gpu()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {why}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
