"""The CUDA MLA decode kernels (versions 1, 2 and 3 of the split kernel) compile for sm_90a without a GPU: no spills,
no stack frame, no wgmma serialization warning, FP8 wgmma (QGMMA) in the SASS with the expected shapes, and a
library exporting only its entry points (so v1 and v2 loaded in one process share no symbol). The ablation builds
(-DMLA_ABLATE_*) compile just as clean and remove exactly the wgmmas they name, the design options
(DESIGN_OPTIONS) compile as clean and keep them all; the ablation script's arguments and
report work without a GPU. Skipped (with the reason) where nvcc is missing."""
from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cuda_tools import cuobjdump
from repo_scripts import load_script

cu = importlib.import_module("sgl_kernel_ext.mla_decode_cuda")

# QGMMA instructions in the SASS per version: (shape, count).
# v1: QK^T m64n32k32 x 18 (16 latent + 2 rope), PV m64n128k32 x 4 (2 halves x 2 k-steps).
# v2: QK^T m64n64k32 x 18; PV m64n128k32 x 8 (the per-tile P'V is inlined twice: own tile and the other WG's).
EXPECTED_QGMMA = {
    1: {"QGMMA.64x32x32.F32.E4M3.E4M3": 18, "QGMMA.64x128x32.F32.E4M3.E4M3": 4},
    2: {"QGMMA.64x64x32.F32.E4M3.E4M3": 18, "QGMMA.64x128x32.F32.E4M3.E4M3": 8},
    # v3, per kernel (N = 16 and 32 rows): QK^T 18 + P'V 8 blocks x 2 k-steps, inlined for full and partial tiles
    3: {"QGMMA.64x16x32.F32.E4M3.E4M3": 18 + 2 * 16, "QGMMA.64x32x32.F32.E4M3.E4M3": 18 + 2 * 16},
}


@pytest.fixture(scope="module", params=cu.VERSIONS, ids=[f"v{v}" for v in cu.VERSIONS])
def compiled(request, tmp_path_factory):
    version = request.param
    nvcc = cu._find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    src = cu.source_path(version)
    if not src.is_file():
        pytest.skip(f"kernel source missing: {src}")
    obj = tmp_path_factory.mktemp(f"mla_cuda_v{version}") / "mla.so"  # the library build() makes
    res = subprocess.run([nvcc, *cu.NVCC_FLAGS, "-Xptxas", "-v", str(src), "-o", str(obj)],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    return version, obj, res.stdout + res.stderr


def every_kernel_clean(log: str) -> bool:
    """ptxas -v compiled at least one entry function and reported every one without stack frame or spills
    (version 3 has two, for 16 and 32 query rows: one clean line must not pass for both)."""
    entries = log.count("Compiling entry function")
    return entries >= 1 and log.count("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads") == entries


def test_ptxas_report(compiled):
    _, _, log = compiled
    print(log)
    assert every_kernel_clean(log), log
    assert "serialized" not in log, "ptxas serialized the wgmma pipeline:\n" + log
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    assert regs and max(regs) <= 255, log


def test_sass_has_fp8_wgmma(compiled):
    version, obj, _ = compiled
    tool = cuobjdump()
    if tool is None:
        pytest.skip("cuobjdump not found")
    sass = subprocess.run([tool, "-sass", str(obj)], capture_output=True, text=True, timeout=120).stdout
    got = {shape: sass.count(shape) for shape in EXPECTED_QGMMA[version]}
    assert got == EXPECTED_QGMMA[version], f"v{version}: QGMMA counts {got}, want {EXPECTED_QGMMA[version]}"
    if version >= 2:  # warp specialization: the register split and no local memory in the math warpgroups
        assert "USETMAXREG" in sass, f"v{version}: setmaxnreg missing from the SASS"
        assert not re.search(r"\b(STL|LDL)\b", sass), f"v{version}: local memory traffic in the SASS"


def test_exports_only_entry_points(compiled):
    """Session 6's failure: a static local of the shared header's launcher was an STB_GNU_UNIQUE symbol, one object
    for both versions' libraries in a process, so v2 launched without its shared-memory attribute after v1 ran."""
    _, obj, _ = compiled
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm not found")
    rows = [line.split() for line in subprocess.run([nm, "-D", "--defined-only", str(obj)], capture_output=True,
                                                    text=True, timeout=60).stdout.splitlines()]
    unique = [r[-1] for r in rows if len(r) >= 3 and r[1] == "u"]
    assert not unique, f"process-wide unique symbols: {unique}"
    funcs = sorted(r[-1] for r in rows if len(r) >= 3 and r[1] == "T" and not r[-1].startswith("_"))
    assert funcs == sorted(cu.ENTRY_POINTS), funcs


# --- ablation builds (benchmark/kernels/mla_cuda_ablation.py) -----------------------------------------------------

ablation = load_script("benchmark/kernels/mla_cuda_ablation.py")

# every switch alone and every variant the ablation script times by default
_SWITCHES = [a[len(ablation.PREFIX):] for a in cu.ABLATIONS]
ABLATION_VARIANTS = list(dict.fromkeys(_SWITCHES + ablation.DEFAULT_VARIANTS)) + list(cu.DESIGN_OPTIONS)
_QK_SHAPE = {1: "QGMMA.64x32x32.F32.E4M3.E4M3", 2: "QGMMA.64x64x32.F32.E4M3.E4M3"}
_PV_SHAPE = "QGMMA.64x128x32.F32.E4M3.E4M3"


@pytest.fixture(scope="module")
def ablation_builds(tmp_path_factory):
    """Each (version, variant) compiled to a cubin (device code only: ~1 s each, all in parallel); the ptxas log and
    the SASS (None without cuobjdump) by key."""
    nvcc = cu._find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found")
    tool = cuobjdump()
    tmp = tmp_path_factory.mktemp("mla_ablation")
    flags = [f for f in cu.NVCC_FLAGS if f.startswith(("-gencode", "-O", "-std"))]
    keys = [(v, name) for v in cu.GENERAL_VERSIONS for name in ABLATION_VARIANTS]

    def one(key):
        version, name = key
        defines = ablation.parse_variant(name, _SWITCHES, cu.DESIGN_OPTIONS)
        out = tmp / f"v{version}_{'_'.join(defines)}.cubin"
        cmd = [nvcc, *flags, "-cubin", "-Xptxas", "-v", *(f"-D{d}" for d in defines), str(cu.source_path(version)),
               "-o", str(out)]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        log = res.stdout + res.stderr
        if res.returncode != 0:
            return key, (f"nvcc failed (rc {res.returncode}):\n{log}", None)
        sass = subprocess.run([tool, "-sass", str(out)], capture_output=True, text=True, timeout=120).stdout \
            if tool else None
        return key, (log, sass)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as ex:
        return dict(ex.map(one, keys))


@pytest.mark.parametrize("version", cu.GENERAL_VERSIONS, ids=[f"v{v}" for v in cu.GENERAL_VERSIONS])
@pytest.mark.parametrize("variant", ABLATION_VARIANTS)
def test_ablation_build(ablation_builds, version, variant):
    """Compiles clean (no spill, no stack frame, no wgmma serialization) and keeps exactly the wgmmas it should:
    ptxas drops a wgmma whose accumulator is never read, so a stand-in gone wrong would remove more than the switch
    names, and the timing would lie."""
    log, sass = ablation_builds[(version, variant)]
    assert "nvcc failed" not in log, log
    assert every_kernel_clean(log), log
    assert "serialized" not in log, "ptxas serialized the wgmma pipeline:\n" + log
    if sass is None:
        pytest.skip("cuobjdump not found")
    defines = ablation.parse_variant(variant, _SWITCHES, cu.DESIGN_OPTIONS)
    base = EXPECTED_QGMMA[version]
    gone = lambda s: any(f"{ablation.PREFIX}{x}" in defines for x in (s, "EMPTY"))  # noqa: E731
    want = {_QK_SHAPE[version]: 0 if gone("NO_QK") else base[_QK_SHAPE[version]],
            _PV_SHAPE: 0 if gone("NO_PV") else base[_PV_SHAPE]}
    got = {shape: sass.count(shape) for shape in want}
    assert got == want, f"v{version} {variant}: QGMMA counts {got}, want {want}"


def test_defines_key_the_build_and_the_library(monkeypatch, tmp_path):
    """An ablation build is its own library (cache file and loaded-library key), whatever the order of its defines;
    the default build's flags are unchanged. nvcc and the loader are faked: no compile."""
    import types
    cmds = []

    def fake_nvcc(cmd, **kw):
        cmds.append(cmd)
        Path(cmd[-1]).write_bytes(b"")
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")
    monkeypatch.setenv("SGLANG_H20_CACHE", str(tmp_path))
    monkeypatch.setattr(cu, "_find_nvcc", lambda: "/fake/nvcc")
    monkeypatch.setattr(subprocess, "run", fake_nvcc)  # cuda_build runs it
    monkeypatch.setattr(cu.ctypes, "CDLL", lambda path: types.SimpleNamespace(
        path=path, **{name: types.SimpleNamespace() for name in cu.ENTRY_POINTS}))
    monkeypatch.setattr(cu, "_libs", {})
    plain = cu.build(verbose=False, version=2)
    ablated = cu.build(verbose=False, version=2, defines=("MLA_ABLATE_NO_QK", "MLA_ABLATE_NO_PV"))
    assert cu.build(verbose=False, version=2, defines=["MLA_ABLATE_NO_PV", "MLA_ABLATE_NO_QK", "MLA_ABLATE_NO_PV"]) \
        == ablated != plain
    assert len(cmds) == 2 and cmds[0][1:-3] == list(cu.NVCC_FLAGS)  # the third build came from the cache
    assert cmds[1][1:-3] == [*cu.NVCC_FLAGS, "-DMLA_ABLATE_NO_PV", "-DMLA_ABLATE_NO_QK"]
    assert cu._load(2).path == str(plain) and cu._load(2, ("MLA_ABLATE_NO_PV", "MLA_ABLATE_NO_QK")).path == str(ablated)
    assert set(cu._libs) == {(2, ()), (2, ("MLA_ABLATE_NO_PV", "MLA_ABLATE_NO_QK"))}
    for bad in ("-DX", "A B", "X;rm"):
        with pytest.raises(ValueError):
            cu.build(version=2, defines=(bad,))


def test_ablation_args_and_points():
    """The script's argument parsing, variant grammar and job list, with no GPU (and no CUDA call)."""
    args = ablation.parse_args([])
    assert args.points == [(64, 4096, 128, 1), (64, 16384, 128, 1), (128, 4096, 128, 1), (128, 16384, 128, 1)]
    assert args.versions == [1, 2] and args.variants == ablation.DEFAULT_VARIANTS
    assert args.variant_defines["default"] == ()
    all_no = tuple(sorted(a for a in cu.ABLATIONS if "_NO_" in a))
    assert args.variant_defines["ALL"] == all_no and len(all_no) == 6
    assert args.variant_defines["NO_QK+NO_PV"] == ("MLA_ABLATE_NO_PV", "MLA_ABLATE_NO_QK")
    jobs = ablation.jobs_for(args)
    per = len(ablation.DEFAULT_VARIANTS) + 2  # the default first and last
    assert len(jobs) == 4 * 2 * per and [j["id"] for j in jobs] == list(range(len(jobs)))
    assert [(j["variant"], j["version"]) for j in jobs[:per]][::per - 1] == [("default", 1), ("default", 1)]
    assert {tuple(j["point"]) for j in jobs} == set(args.points)

    args = ablation.parse_args(["--points", "128x16384x16x2", "1X1024", "--versions", "2",
                                "--variants", "ALL-NO_LOAD", "no_pv"])
    assert args.points == [(128, 16384, 16, 2), (1, 1024, 128, 1)] and args.versions == [2]
    assert args.variant_defines["ALL-NO_LOAD"] == tuple(d for d in all_no if d != "MLA_ABLATE_NO_LOAD")
    assert args.variant_defines["no_pv"] == ("MLA_ABLATE_NO_PV",)
    assert len(ablation.jobs_for(args)) == 2 * 1 * 4
    opt = cu.DESIGN_OPTIONS[0]
    args = ablation.parse_args(["--variants", opt, f"{opt}+NO_TRANSPOSE"])
    assert args.variant_defines[opt] == (opt,)  # taken by its full -D name, combinable with the switches
    assert args.variant_defines[f"{opt}+NO_TRANSPOSE"] == tuple(sorted((opt, "MLA_ABLATE_NO_TRANSPOSE")))
    for bad in (["--points", "64"], ["--points", "64x0"], ["--variants", "NO_SUCH"], ["--variants", "NO_PV-NO_PV"],
                ["--variants", "NO_PV*NO_QK"], ["--versions", "3"]):
        with pytest.raises(SystemExit):
            ablation.parse_args(bad)


def test_ablation_report(capsys):
    """saved = the default's mean (timed first and last) minus the variant; errors are rows, not crashes."""
    args = ablation.parse_args(["--points", "64x4096", "--versions", "1", "2", "--variants", "NO_PV", "EMPTY"])
    jobs = ablation.jobs_for(args)
    us = {("default", 1): 230.0, ("NO_PV", 1): 200.0, ("default", 2): 220.0, ("NO_PV", 2): 221.0}
    results, n = {}, {}
    for j in jobs:
        key = (j["variant"], j["version"])
        n[key] = n.get(key, 0) + 1
        if key == ("EMPTY", 2):
            results[j["id"]] = {**j, "error": "RuntimeError: boom"}
        else:
            t = us.get(key, 10.0) + (4.0 if n[key] == 2 else 0.0)  # the second default run 4 us slower
            results[j["id"]] = {**j, "us": t, "timing": "cuda-graph", "num_splits": 3, "input_sets": 1, "sms": 132}
    rows = {(r["version"], r["variant"]): r for r in ablation.summarize(jobs, results)}
    assert len(rows) == 6
    d1 = rows[(1, "default")]
    assert d1["us"] == d1["default_us"] == 232.0 and d1["noise_us"] == 4.0 and d1["default_runs_us"] == [230.0, 234.0]
    assert d1["ctas"] == 2 * 3 * 64 and d1["ns_per_tile"] == pytest.approx(232.0e3 * 132 / (64 * 2 * 64))
    assert rows[(1, "NO_PV")]["saved_us"] == pytest.approx(32.0)
    assert rows[(2, "NO_PV")]["saved_us"] == pytest.approx(1.0)
    assert rows[(2, "EMPTY")]["error"] == "RuntimeError: boom" and "us" not in rows[(2, "EMPTY")]
    ablation.print_table(list(rows.values()), args.versions, args.variants)
    out = capsys.readouterr().out
    assert "B=64 ctx=4096 H=128 T=1" in out and "ERROR" in out and "±4.0" in out and "32.0" in out


def test_ablation_needs_gpu(monkeypatch, capsys):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ablation.main(["--points", "64x4096"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.parametrize("cap,problem", [((9, 0), None), ((8, 0), "device is sm_80"), ((9, 1), "device is sm_91"),
                                         ((10, 0), "device is sm_100")])
def test_only_sm90_devices_run_the_sm90a_kernels(monkeypatch, cap, problem):
    """sm_90a code runs on sm_90 alone (H100, H200, H20): any other capability gets the reason, not a launch."""
    import torch

    from sgl_kernel_ext import cuda_build

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: cap)
    got = cuda_build.device_problem()
    assert got is None if problem is None else (problem in got and "needs sm_90 (Hopper)" in got)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_build.device_problem() == "no CUDA device"


def test_descriptor_advance_equals_a_fresh_descriptor():
    """csrc's desc_add(desc_sw64(a), n) == desc_sw64(a + n) (python mirrors of both): the kernels build one descriptor
    per operand and advance it per wgmma, exact while a + n stays below 256 KB of shared memory (228 KB on sm_90)."""
    def desc_sw64(a):
        return ((a & 0x3FFFF) >> 4) | (1 << 16) | ((512 >> 4) << 32) | (2 << 62)

    def desc_add(d, n):
        return (d & 0xFFFFFFFF00000000) | ((d + (n >> 4)) & 0xFFFFFFFF)
    smem = 228 * 1024
    for a in range(0, smem, 1024 + 16):  # operand bases (the kernels' are 1 KB aligned; also off-alignment ones)
        for n in (0, 32, 4096, 4096 + 32, 8 * 4096 + 32, 8 * 4608 + 32, 8192 + 32):
            if a + n < smem:
                assert desc_add(desc_sw64(a), n) == desc_sw64(a + n), (a, n)


def test_v3_design_options_build_clean():
    """Version 3 with MLA_SPLIT_Q (Q read as two parts, the backend's default) and with MLA_EAGER_RESCALE: no spill,
    no stack frame, the same wgmmas as the default build, and no atomics in any."""
    nvcc, tool = cu._find_nvcc(), cuobjdump()
    if nvcc is None or tool is None:
        pytest.skip("nvcc or cuobjdump not found")
    flags = [f for f in cu.NVCC_FLAGS if f.startswith(("-gencode", "-O", "-std"))]
    sass = {}
    for defines in ((), ("MLA_SPLIT_Q",), ("MLA_EAGER_RESCALE", "MLA_SPLIT_Q")):
        out = Path(os.environ.get("TMPDIR", "/tmp")) / f"mla_v3_{os.getpid()}_{'_'.join(defines) or 'default'}.cubin"
        res = subprocess.run([nvcc, *flags, "-cubin", "-Xptxas", "-v", *(f"-D{d}" for d in defines),
                              str(cu.source_path(3)), "-o", str(out)], capture_output=True, text=True, timeout=300)
        log = res.stdout + res.stderr
        assert res.returncode == 0, log
        assert every_kernel_clean(log) and log.count("Compiling entry function") == 2, log
        sass[defines] = subprocess.run([tool, "-sass", str(out)], capture_output=True, text=True, timeout=120).stdout
        out.unlink()
        for shape, n in EXPECTED_QGMMA[3].items():
            assert sass[defines].count(shape) == n, (defines, shape)
    assert not any(re.search(r"\bATOM\b", text) for text in sass.values())
