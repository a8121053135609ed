"""The v2 kernel's trace build (-DMLA_TRACE, csrc/mla_fp8_trace.cuh) and benchmark/kernels/trace_mla_decode.py's
reading of the stamps. The build needs nvcc (no GPU); the stamp logic is plain Python."""
import importlib
import re
import shutil
import subprocess

import pytest

from repo_scripts import REPO, load_script
from test_mla_decode_cuda_build import every_kernel_clean

cu = importlib.import_module("sgl_kernel_ext.mla_decode_cuda")

trace = load_script("benchmark/kernels/trace_mla_decode.py")

TRACE_ENTRY_POINTS = ("mla_fp8_trace_reset", "mla_fp8_trace_read", "mla_fp8_trace_shape")


def _stamp(code, t):
    return (code << 56) | t


def test_decode_and_segments():
    events = [[_stamp(1, 1000), _stamp(10, 1010), _stamp(11, 1050), _stamp(20, 1300), _stamp(30, 1400),
               _stamp(31, 1500), _stamp(99, 7)],  # past the count: ignored
              [_stamp(1, 1005), _stamp(2, 1006), _stamp(3, 1100), _stamp(5, 1200)]]
    stamps = trace.decode_stamps(events, [6, 4])
    assert stamps[0][0] == (1, 1000) and len(stamps[0]) == 6 and stamps[1][-1] == (5, 1200)
    segs = trace.segments(stamps)
    assert segs[0] == [("start", 0, 10), ("WG barrier (V^T reuse)", 10, 50), ("wait K tile", 50, 300),
                       ("V^T transpose", 300, 400), ("epilogue", 400, 500)]
    assert segs[1] == [("start", 5, 6), ("loader: wait free K stage", 6, 100), ("loader: issue copies", 100, 200)]


def test_summary_per_warpgroup():
    segs = [[("wait K tile", 0, 100), ("softmax", 100, 400)]] * 4 + [[("softmax", 0, 200)]] * 4 \
        + [[("loader: wait free K stage", 0, 350)]] * 4
    s = trace.summarize(segs, tiles=2)
    assert s["span_cycles"] == 400 and s["cycles_per_tile"] == 200
    wg0 = s["warpgroups"]["WG0 (math)"]
    assert wg0["cycles"] == {"softmax": 300, "wait K tile": 100}
    assert wg0["waiting_share"] == 0.25 and wg0["per_tile"]["softmax"] == 150
    assert s["warpgroups"]["loader"]["waiting_share"] == 0.875
    assert s["warpgroups"]["WG1 (math)"]["waiting_share"] == 0.0


def test_concurrency_of_the_two_math_warpgroups():
    # WG0: softmax 0-100, QK^T wait 100-300, wait P' 300-400; WG1: QK^T wait 0-100, softmax 100-250, PV 250-400
    wg0 = [("softmax", 0, 100), ("QK^T wgmma wait", 100, 300), ("wait P' of the tile", 300, 400)]
    wg1 = [("QK^T wgmma wait", 0, 100), ("softmax", 100, 250), ("PV wgmma + merge", 250, 400)]
    c = trace.concurrency([wg0] * 4 + [wg1] * 4)
    assert c["cycles"] == {"cuda|tensor": 100, "tensor|cuda": 150, "tensor|tensor": 50, "sync|tensor": 100}
    assert c["span_cycles"] == 400 and c["seesaw_share"] == 0.625 and c["both_tensor_share"] == 0.125
    assert c["both_cuda_share"] == 0.0
    # lockstep: both WGs do the same thing at the same time -> no seesaw at all
    lock = trace.concurrency([wg0] * 4 + [wg0] * 4)
    assert lock["seesaw_share"] == 0.0 and lock["both_cuda_share"] == 0.25 and lock["both_tensor_share"] == 0.5
    assert trace.concurrency([])["span_cycles"] == 0


def test_plot_writes_a_png(tmp_path):
    segs = [[("wait K tile", 0, 100), ("softmax", 100, 400)]] * 8 + [[("loader: issue copies", 0, 50)]] * 4
    trace.plot(segs, tmp_path / "t.png", "synthetic")
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_stamped_code_has_a_phase():
    src = (REPO / "sgl-kernel-ext/sgl_kernel_ext/csrc/mla_fp8_decode_sm90_v2.cu").read_text()
    codes = {int(c) for c in re.findall(r"MLA_TRACE\((\d+)\)", src)}
    assert codes and codes <= set(trace.PHASE_AFTER) | set(trace.END_CODES), codes


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    nvcc = cu._find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    out = {}
    for name, extra in (("plain", []), ("traced", ["-DMLA_TRACE"])):
        obj = tmp_path_factory.mktemp(f"v2_{name}") / "mla.so"
        res = subprocess.run([nvcc, *cu.NVCC_FLAGS, *extra, "-Xptxas", "-v", str(cu.source_path(2)), "-o", str(obj)],
                             capture_output=True, text=True, timeout=240)
        assert res.returncode == 0, res.stdout + res.stderr
        out[name] = (obj, res.stdout + res.stderr)
    return out


def test_trace_build_is_clean_and_exports_its_entry_points(builds):
    obj, log = builds["traced"]
    assert every_kernel_clean(log), log
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not found")

    def exported(path):
        rows = [r.split() for r in subprocess.run([nm, "-D", "--defined-only", str(path)], capture_output=True,
                                                  text=True, timeout=60).stdout.splitlines()]
        return sorted(r[-1] for r in rows if len(r) >= 3 and r[1] == "T" and not r[-1].startswith("_"))

    assert exported(obj) == sorted(cu.ENTRY_POINTS + TRACE_ENTRY_POINTS)
    assert exported(builds["plain"][0]) == sorted(cu.ENTRY_POINTS)  # the default build carries no trace code
