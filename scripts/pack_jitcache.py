#!/usr/bin/env python3
"""Pack the device host's JIT caches (/tmp/jit: Triton, Inductor, TVM-FFI, DeepGEMM, FlashInfer, the CUDA driver's
PTX cache) into one archive for $OUT, so the next call can restore them (carry it as .devkit/jitcache.tar.xz) instead
of compiling again.

The device tool brings back files of at most 16 MiB. A cache over that is packed again without the caches least
worth their bytes (the driver's PTX cache, which stayed empty; then TVM-FFI's, 6-9 s of nvcc per module by their
ninja logs; then FlashInfer's, whose prefill module held the first server ~65 s), and only then harder, so that the
Triton kernels, whose compiling costs each server start tens of seconds, still come back. Fast presets first: this
runs at the end of a device call, on its clock (xz -9e over the ~150 MB cache would take minutes).

Triton's intermediate files (.ttir, .ttgir, .llir, .ptx, .source) are never packed: a cache hit reads only a kernel's
.json metadata and its .cubin (triton 3.6 `get_group` skips a group's missing files), and they were 80% of its bytes
(2026-12-02: 81 MB of Triton cache, 12.5 MB without them; ~4 MB packed with FlashInfer's and TVM-FFI's).

Every mtime is packed rounded down to the second. FlashInfer and TVM-FFI build with ninja, whose deps log records
each object's mtime in ns and rebuilds an object whose file is newer than that record; tar's float mtimes came
back up to ~100 ns later, so some objects of every restored module were rebuilt (FlashInfer's prefill module,
~65 s of the first server's start on 2026-12-02, its objects' mtimes from three different calls)."""
import argparse
import os
import sys
import tarfile

LIMIT = 15_500_000  # the device tool brings back files of at most 16 MiB
JIT_DIR = "/tmp/jit"
DROP_ORDER = ("cuda-compute", "tvm-ffi", "flashinfer")  # left out first when the archive is too large
TRITON_IR = (".ttir", ".ttgir", ".llir", ".ptx", ".source")  # compiler stages a Triton cache hit does not read


def packable(member: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """tar filter: drop Triton's intermediate files; round mtimes down to the second (never later than ninja's)."""
    if member.name.split("/")[0] == "triton" and member.name.endswith(TRITON_IR):
        return None
    member.mtime = int(member.mtime)
    return member


def attempts(present) -> list:
    """(xz preset, caches left out): everything, then one more of DROP_ORDER's present caches left out at a time,
    then the smallest at a slower preset."""
    drop = tuple(d for d in DROP_ORDER if d in present)
    return [(3, drop[:i]) for i in range(len(drop) + 1)] + [(6, drop)]


def pack(jit_dir: str, out: str, limit: int) -> tuple[int, tuple[str, ...]] | None:
    """Write the archive; (its size, the caches left out), or None when even the smallest is over `limit`."""
    for preset, left_out in attempts(os.listdir(jit_dir)):
        with tarfile.open(out, "w:xz", preset=preset) as t:
            for d in sorted(os.listdir(jit_dir)):
                if d not in left_out:
                    t.add(os.path.join(jit_dir, d), arcname=d, filter=packable)
        size = os.path.getsize(out)
        if size <= limit:
            return size, left_out
    os.remove(out)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the archive to write (.tar.xz); none is left when every attempt is over --limit")
    ap.add_argument("--jit-dir", default=JIT_DIR, help="the caches' folder (default: %(default)s)")
    ap.add_argument("--limit", type=int, default=LIMIT, help="largest archive, bytes (default: %(default)s)")
    a = ap.parse_args(argv)
    if not os.path.isdir(a.jit_dir):
        print(f"pack_jitcache: no {a.jit_dir} here: nothing to pack", file=sys.stderr)
        return 1
    got = pack(a.jit_dir, a.out, a.limit)
    if got is None:
        print(f"jit cache too large to bring back, even without {', '.join(DROP_ORDER)}")
    elif got[1]:
        print(f"jit cache packed without {', '.join(got[1])} ({got[0] / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
