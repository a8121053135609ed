"""On the GPU host: the guards see a Hopper GPU, and the plugin's decisions there are the expected ones."""
import pytest

from sglang_h20 import compat
from sglang_h20.features import FEATURES, decide
from sglang_h20.settings import Settings

pytestmark = pytest.mark.gpu


def test_gpu_is_hopper_class():
    """Runs only where the guard already saw a Hopper-class GPU; what stops a device run whose guard sees none is
    test/conftest.py's SGLANG_H20_EXPECT_GPU check (gpu_check.sh sets it). Here: the GPU's own numbers."""
    ok, why = compat.check_gpu()
    assert ok, why
    assert compat.gpu().capability >= (9, 0)


def test_all_off_by_default_on_gpu():
    s = Settings.from_env({})
    for f in FEATURES:
        d = decide(f, s)
        assert not d.on and "switched off" in d.reason, (f.name, d.reason)
