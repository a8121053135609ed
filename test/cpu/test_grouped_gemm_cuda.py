"""The hand-written CUDA grouped GEMM (sgl_kernel_ext.grouped_gemm_cuda, csrc/grouped_gemm_fp8_sm90.cu) without a GPU:
each tile form compiles for sm_90a within the 384-thread register budget (168 at launch) with no spills and no
serialized wgmma, the SASS holds only the m64nNk32 FP8 wgmmas (four per K block), and the Python entry rejects bad
operands and unknown forms with a clear error before any build. Its numerics run on the GPU
(test/gpu/test_grouped_gemm_fp8_gpu.py, test_cuda_normal_variant_moe_shapes). Skipped (with the reason) where nvcc
is missing."""
from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from cuda_tools import cuobjdump
from sgl_kernel_ext import cuda_build
from sgl_kernel_ext import grouped_gemm_cuda as ggc

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "kernels"))
import bench_grouped_gemm as bench  # noqa: E402
import grouped_gemm_cuda_ablation as ablation  # noqa: E402


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    nvcc = cuda_build.find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    obj = tmp_path_factory.mktemp("gg_cuda") / "gg.so"
    res = subprocess.run([nvcc, *cuda_build.NVCC_FLAGS, "-Xptxas", "-v", str(ggc.SOURCE), "-o", str(obj)],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    return obj, res.stdout + res.stderr


def test_ptxas_report(compiled):
    _, log = compiled
    entries = log.count("Compiling entry function")
    assert entries == len(ggc.FORMS), log  # one kernel per tile form
    assert log.count("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads") == entries, log
    assert "serialized" not in log, "ptxas serialized the wgmma pipeline:\n" + log
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    assert regs and max(regs) <= 168, log  # 384 threads x 168 fill the register file; setmaxnreg moves them


def test_sass_has_the_fp8_wgmmas(compiled):
    obj, _ = compiled
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found")
    sass = subprocess.run([tool, "-sass", str(obj)], capture_output=True, text=True, timeout=120).stdout
    found = re.findall(r"QGMMA\.\w+\.\w+\.\w+\.\w+", sass)
    # one K block is four m64nNk32 (N: the warp group's columns, 192 in the 128x192 forms, else 128); the
    # double-buffered (d) forms issue it at three places (before the loop, and for each of the two scratch
    # accumulators in it); the 128x192 forms have two K loops (their promotions' column splits, 64 and 128)
    expected = {}
    for form in ggc.FORMS:
        wide = form.startswith("128x192")
        key = f"QGMMA.64x{192 if wide else 128}x32.F32.E4M3.E4M3"
        expected[key] = expected.get(key, 0) + (12 if "d" in form.partition("-")[2] else 4) * (2 if wide else 1)
    assert {key: found.count(key) for key in set(found)} == expected, found


@pytest.mark.parametrize("switch", ggc.ABLATIONS)
def test_ablation_builds_remove_only_their_part(switch, tmp_path):
    """Each ablation build compiles as clean as the normal one; NO_MMA drops every wgmma and keeps every promotion
    FFMA (ptxas may not fold them: the timing would lie), NO_LOAD keeps every wgmma and TMA copy site."""
    nvcc, tool = cuda_build.find_nvcc(), cuobjdump()
    if nvcc is None or tool is None:
        pytest.skip("nvcc or cuobjdump not found")
    flags = [f for f in cuda_build.NVCC_FLAGS if f.startswith(("-gencode", "-O", "-std"))]

    def build(*defines):
        out = tmp_path / f"{'_'.join(defines) or 'normal'}.cubin"
        res = subprocess.run([nvcc, *flags, "-cubin", "-Xptxas", "-v", *(f"-D{d}" for d in defines), str(ggc.SOURCE),
                              "-o", str(out)], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout + res.stderr
        sass = subprocess.run([tool, "-sass", str(out)], capture_output=True, text=True, timeout=120).stdout
        return res.stdout + res.stderr, {op: len(re.findall(rf"\b{op}\b", sass)) for op in ("QGMMA", "FFMA", "UTMALDG")}
    log, counts = build(switch)
    _, normal = build()
    assert log.count("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads") == len(ggc.FORMS), log
    want = {**normal, "QGMMA": 0} if switch.endswith("NO_MMA") else normal
    assert counts == want and normal["QGMMA"] > 0, (counts, normal)


def test_ablation_defines_are_checked_and_the_script_parses():
    with pytest.raises(ValueError, match="unknown defines"):
        ggc._load(("GG_ABLATE_NOTHING",))
    args = ablation.parse_args(["--points", "down:32:128", "--variants", "NO_LOAD+NO_MMA"])
    assert args.points == [("down", 32, 128)]
    assert args.variant_defines == {"NO_LOAD+NO_MMA": ("GG_ABLATE_NO_LOAD", "GG_ABLATE_NO_MMA")}
    for bad in (["--variants", "NO_QK"], ["--points", "up:8:8"]):
        with pytest.raises(SystemExit):
            ablation.parse_args(bad)


def _operands(groups=2, n=256, k=256, rows=8):
    a = torch.zeros(rows, k, dtype=torch.float8_e4m3fn)
    a_s = torch.ones(rows, k // 128)
    b = torch.zeros(groups, n, k, dtype=torch.float8_e4m3fn)
    b_s = torch.ones(groups, n // 128, k // 128)
    indptr = torch.tensor([0, 4, 8], dtype=torch.int32)
    return a, a_s, b, b_s, indptr


@pytest.mark.parametrize("bad, message", [
    ("both", "exactly one"), ("neither", "exactly one"), ("n", "multiples of 128"), ("dtype", "float8_e4m3fn"),
    ("b_scale", re.escape("b_scale must be (2, 2, 2), got (2, 1, 2)")),
    ("a_scale", re.escape("a_scale must be (8, 2), got (8, 1)")), ("indptr", "m_indptr must be"),
    ("masked_a", "masked a must be"), ("out", re.escape("out must be contiguous bf16 (8, 256)")),
    ("form", "unknown form"), ("n_for_form", "multiple of 256"), ("n_for_multicast", "even number of column blocks"),
    ("scale_dtype", "a_scale and b_scale must be float32"), ("b_strides", "b must be contiguous"),
    ("groups", re.escape("groups must be 1..1024, got 1025"))])
def test_bad_operands_are_refused_before_any_build(bad, message, monkeypatch):
    monkeypatch.setattr(ggc, "_load", lambda *_: pytest.fail("built or loaded for bad operands"))
    a, a_s, b, b_s, indptr = _operands()
    kw = {"m_indptr": indptr}
    if bad == "both":
        kw["masked_m"] = torch.tensor([4, 4], dtype=torch.int32)
    elif bad == "neither":
        kw = {}
    elif bad == "n":
        b, b_s = torch.zeros(2, 200, 256, dtype=torch.float8_e4m3fn), torch.ones(2, 2, 2)
    elif bad == "dtype":
        a = a.float()
    elif bad == "b_scale":
        b_s = torch.ones(2, 1, 2)
    elif bad == "a_scale":
        a_s = torch.ones(8, 1)
    elif bad == "indptr":
        kw = {"m_indptr": indptr.long()}
    elif bad == "masked_a":
        kw = {"masked_m": torch.tensor([4, 4], dtype=torch.int32)}
    elif bad == "out":
        kw["out"] = torch.empty(8, 256)
    elif bad == "form":
        kw["form"] = "32x32"
    elif bad == "n_for_form":
        b, b_s = torch.zeros(2, 384, 256, dtype=torch.float8_e4m3fn), torch.ones(2, 3, 2)
        kw["form"] = "64x256-pd"
    elif bad == "n_for_multicast":  # one column block of 192: no pair
        b, b_s = torch.zeros(2, 128, 256, dtype=torch.float8_e4m3fn), torch.ones(2, 1, 2)
        kw["form"] = "128x192-sm"
    elif bad == "scale_dtype":  # the weights' scales alone in another dtype
        b_s = b_s.double()
    elif bad == "b_strides":  # [G, N, K] by shape, stored as [G, K, N] (N the fast dimension)
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
    elif bad == "groups":  # one past the kernel's per-CTA tile table
        b, b_s = torch.zeros(1025, 128, 256, dtype=torch.float8_e4m3fn), torch.ones(1025, 1, 2)
        kw["m_indptr"] = torch.zeros(1026, dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        ggc.m_grouped_fp8_gemm_nt_cuda(a, a_s, b, b_s, **kw)


@pytest.mark.parametrize("a_shape, masked, message", [((3, 4, 256), True, "masked a must be"),
                                                      ((2, 4, 256), False, "contiguous a must be")])
def test_the_layout_and_a_must_agree(a_shape, masked, message, monkeypatch):
    """Masked: a is [groups, max_m, K] (here 3 groups of a for 2 experts); contiguous: a is [M, K]."""
    monkeypatch.setattr(ggc, "_load", lambda *_: pytest.fail("built or loaded for bad operands"))
    _, _, b, b_s, indptr = _operands()
    a = torch.zeros(*a_shape, dtype=torch.float8_e4m3fn)
    a_s = torch.ones(*a_shape[:-1], 2)
    kw = {"masked_m": torch.tensor([4, 4], dtype=torch.int32)} if masked else {"m_indptr": indptr}
    with pytest.raises(ValueError, match=message):
        ggc.m_grouped_fp8_gemm_nt_cuda(a, a_s, b, b_s, **kw)


class FakeLib:
    """Records what the launcher passes to the CUDA library."""
    def __init__(self):
        self.calls = []

    def grouped_gemm_fp8_sm90(self, *args):
        self.calls.append(args)
        return 0


def test_the_launch_gets_the_rows_the_layout_and_the_scale_strides(monkeypatch):
    """Contiguous: rows = M, max_m 0, a_scale's strides behind a 0 group stride; masked: rows = G * max_m, max_m,
    a_scale's own 3-D strides; no rows: the output comes back without a launch."""
    lib = FakeLib()
    monkeypatch.setattr(ggc, "_load", lambda *_: lib)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *_: types.SimpleNamespace(cuda_stream=7))
    a, a_s, b, b_s, indptr = _operands()
    out = ggc.m_grouped_fp8_gemm_nt_cuda(a, a_s, b, b_s, m_indptr=indptr, num_sms=5)
    assert out.shape == (8, 256) and out.dtype == torch.bfloat16
    given = torch.empty(8, 256, dtype=torch.bfloat16)
    assert ggc.m_grouped_fp8_gemm_nt_cuda(a, a_s, b, b_s, m_indptr=indptr, out=given, num_sms=5) is given
    args = lib.calls[-1]
    assert args[7] == given.data_ptr()
    assert args[2:5] == (0, *a_s.stride())  # the scale strides: group, row, K block
    assert args[10:] == (8, 2, 0, 256, 256, 5, ggc.FORMS.index(ggc.DEFAULT_FORM), 7)
    mn = ggc.mn_major(a_s)
    assert torch.equal(mn, a_s) and mn.stride() == (1, 8)  # the same values, the rows contiguous per K block
    ggc.m_grouped_fp8_gemm_nt_cuda(a, mn, b, b_s, m_indptr=indptr, num_sms=5)
    assert lib.calls[-1][2:5] == (0, 1, 8)
    am = torch.zeros(2, 4, 256, dtype=torch.float8_e4m3fn)
    am_s = torch.ones(2, 4, 2)
    out = ggc.m_grouped_fp8_gemm_nt_cuda(am, am_s, b, b_s, masked_m=torch.tensor([4, 1], dtype=torch.int32),
                                         num_sms=5)
    assert out.shape == (2, 4, 256)
    args = lib.calls[-1]
    assert args[2:5] == am_s.stride() and args[10:13] == (8, 2, 4)
    calls = len(lib.calls)
    empty = ggc.m_grouped_fp8_gemm_nt_cuda(a[:0], a_s[:0], b, b_s, m_indptr=torch.zeros(3, dtype=torch.int32),
                                           num_sms=5)
    assert empty.shape == (0, 256) and len(lib.calls) == calls


def test_unavailable_without_a_gpu_says_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ggc.available() == (False, "no CUDA device")


def test_a_failed_build_is_unavailable_and_tried_once(monkeypatch):
    """On a usable GPU whose build fails, available() says why, and later calls reuse that answer (no new build)."""
    tries = []

    def failing_load(*_):
        tries.append(1)
        raise RuntimeError("nvcc exited 1")

    monkeypatch.setattr(ggc, "device_problem", lambda: "")
    monkeypatch.setattr(ggc, "_lib_error", None)
    monkeypatch.setattr(ggc, "_load", failing_load)
    assert ggc.available() == (False, "build/load failed: nvcc exited 1")
    assert ggc.available() == (False, "build/load failed: nvcc exited 1") and len(tries) == 1
    monkeypatch.setattr(ggc, "_lib_error", None)
    monkeypatch.setattr(ggc, "_load", lambda *_: object())  # a build that loads
    assert ggc.available() == (True, "")


def test_bench_times_it_only_when_asked():
    assert "ours-cuda" not in bench.parse_args([]).providers
    assert bench.parse_args(["--providers", "ours-cuda", "deepgemm"]).providers == ["ours-cuda", "deepgemm"]
    assert bench.parse_args([]).cuda_forms == list(ggc.FORMS)
    assert bench.parse_args(["--cuda-forms", "128x192-s"]).cuda_forms == ["128x192-s"]
    assert bench.parse_args([]).cuda_min_tokens == 1  # every point unless asked
    assert bench.parse_args(["--cuda-min-tokens", "64"]).cuda_min_tokens == 64
    with pytest.raises(SystemExit):
        bench.parse_args(["--cuda-forms", "32x32"])


def test_tile_shapes():
    assert [ggc.tile_shape(f) for f in ggc.FORMS] == [(64, 256), (128, 128), (128, 192), (128, 192), (128, 192)]


def test_nvcc_is_found_in_order_and_only_as_an_executable_file(monkeypatch, tmp_path):
    """SGLANG_H20_NVCC first, then PATH, then $CUDA_HOME/bin; a candidate that is missing or not executable is
    passed over (a typo in the variable falls back to the next, it never becomes the command)."""
    def tool(folder, mode=0o755):
        path = tmp_path / folder / "nvcc"
        path.parent.mkdir(parents=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(mode)
        return str(path)
    mine, on_path, home = tool("mine"), tool("path"), tool("home/bin")
    real_isfile = cuda_build.os.path.isfile
    monkeypatch.setattr(cuda_build.os.path, "isfile",  # this host's own /usr/local/bin/nvcc stays unseen
                        lambda p: real_isfile(p) and str(p).startswith(str(tmp_path)))
    monkeypatch.setenv("PATH", str(tmp_path / "path"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SGLANG_H20_NVCC", mine)
    assert cuda_build.find_nvcc() == mine
    monkeypatch.setenv("SGLANG_H20_NVCC", str(tmp_path / "typo" / "nvcc"))
    assert cuda_build.find_nvcc() == on_path
    monkeypatch.setenv("SGLANG_H20_NVCC", tool("plain", mode=0o644))  # a file, not executable
    assert cuda_build.find_nvcc() == on_path
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert cuda_build.find_nvcc() == home
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "none"))
    assert cuda_build.find_nvcc() is None


def test_without_nvcc_the_build_says_where_it_looked(tmp_path):
    with pytest.raises(RuntimeError, match=r"nvcc not found \(PATH, \$CUDA_HOME/bin, or set SGLANG_H20_NVCC\)"):
        cuda_build.compile_library(ggc.SOURCE, cuda_build.NVCC_FLAGS, None)
