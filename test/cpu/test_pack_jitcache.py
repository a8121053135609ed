"""scripts/pack_jitcache.py: a JIT cache over the device tool's file limit still brings the Triton kernels back."""
import os
import tarfile

import pytest

from repo_scripts import load_script

pj = load_script("scripts/pack_jitcache.py")


@pytest.fixture
def jit(tmp_path):
    d = tmp_path / "jit"
    for name, nbytes in (("triton", 60_000), ("flashinfer", 120_000), ("tvm-ffi", 80_000)):
        (d / name / "k").mkdir(parents=True)
        (d / name / "k" / "blob.bin").write_bytes(os.urandom(nbytes))  # random: xz cannot shrink it
    return d


def members(path):
    with tarfile.open(path) as t:
        return sorted({m.name.split("/")[0] for m in t.getmembers()})


@pytest.mark.parametrize("limit, left_out", [(10**6, ()), (200_000, ("tvm-ffi",)),
                                            (100_000, ("tvm-ffi", "flashinfer"))])
def test_drops_the_least_useful_caches_until_it_fits(jit, tmp_path, limit, left_out):
    out = tmp_path / "jitcache.tar.xz"
    size, dropped = pj.pack(str(jit), str(out), limit)
    assert dropped == left_out and size == out.stat().st_size <= limit
    assert members(out) == sorted({"triton", "flashinfer", "tvm-ffi"} - set(left_out))


def test_too_large_even_alone_leaves_no_archive(jit, tmp_path, capsys):
    out = tmp_path / "jitcache.tar.xz"
    assert pj.main([str(out), "--jit-dir", str(jit), "--limit", "30000"]) == 0
    assert not out.exists() and "too large" in capsys.readouterr().out
    assert pj.main([str(out), "--jit-dir", str(tmp_path / "absent")]) == 1


def test_the_drivers_empty_ptx_cache_goes_first_flashinfer_last(jit, tmp_path):
    (jit / "cuda-compute" / "k").mkdir(parents=True)
    (jit / "cuda-compute" / "k" / "blob.bin").write_bytes(os.urandom(50_000))
    assert pj.attempts(os.listdir(jit))[1:4] == [(3, ("cuda-compute",)), (3, ("cuda-compute", "tvm-ffi")),
                                                (3, ("cuda-compute", "tvm-ffi", "flashinfer"))]
    out = tmp_path / "jitcache.tar.xz"
    size, dropped = pj.pack(str(jit), str(out), 200_000)  # 310 KB in all; 180 KB without those two
    assert dropped == ("cuda-compute", "tvm-ffi") and members(out) == ["flashinfer", "triton"]


def test_triton_keeps_only_what_a_cache_hit_reads(jit, tmp_path):
    kernel = jit / "triton" / "HASH"
    kernel.mkdir()
    for ext in ("cubin", "json", "ttir", "ttgir", "llir", "ptx", "source"):
        (kernel / f"k.{ext}").write_text(ext)
    (kernel / "__grp__k.json").write_text("{}")
    (jit / "tvm-ffi" / "k" / "kernel.ptx").write_text("other caches keep every file")
    out = tmp_path / "jitcache.tar.xz"
    pj.pack(str(jit), str(out), 10**6)
    with tarfile.open(out) as t:
        names = {m.name for m in t.getmembers() if m.isfile()}
    assert {n for n in names if n.startswith("triton/HASH/")} == {
        "triton/HASH/k.cubin", "triton/HASH/k.json", "triton/HASH/__grp__k.json"}
    assert "tvm-ffi/k/kernel.ptx" in names


def test_mtimes_come_back_no_later_than_ninja_recorded(jit, tmp_path):
    obj = jit / "flashinfer" / "k" / "kernel.cuda.o"
    obj.write_bytes(b"o")
    ns = 1_796_160_570_818_275_357  # as a float this mtime reads back 94 ns later (unrounded, ninja rebuilt)
    os.utime(obj, ns=(ns, ns))
    out = tmp_path / "jitcache.tar.xz"
    pj.pack(str(jit), str(out), 10**6)
    with tarfile.open(out) as t:
        # the extraction filter exists from Python 3.11.4 (3.11.2 on Debian 12 lacks it)
        t.extractall(tmp_path / "restored", **({"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}))
    restored = (tmp_path / "restored" / "flashinfer" / "k" / "kernel.cuda.o").stat().st_mtime_ns
    assert restored <= ns and ns - restored < 10**9
