#!/usr/bin/env python3
"""Pack the device host's JIT caches (/tmp/jit: Triton, TVM-FFI, DeepGEMM, FlashInfer) into one archive for $OUT,
so the next call can restore them (carry it as .devkit/jitcache.tar.xz) instead of compiling again."""
import argparse
import os
import sys
import tarfile

LIMIT = 15_500_000  # the device tool brings back files of at most 16 MiB
JIT_DIR = "/tmp/jit"

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("out", help="the archive to write (.tar.xz); removed again when it is over the "
                            f"{LIMIT / 1e6:.1f} MB the device tool brings back")
a = ap.parse_args()
if not os.path.isdir(JIT_DIR):
    sys.exit(f"pack_jitcache: no {JIT_DIR} here: nothing to pack")
out = a.out
with tarfile.open(out, "w:xz", preset=3) as t:
    for d in sorted(os.listdir(JIT_DIR)):
        t.add(os.path.join(JIT_DIR, d), arcname=d)
if os.path.getsize(out) > LIMIT:
    os.remove(out)
    print("jit cache too large to bring back")
