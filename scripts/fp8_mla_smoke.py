#!/usr/bin/env python3
"""Smoke test of the h20_fp8_mla backend in the real server (GPU host): start it on a dummy model, greedy-decode a few
prompts twice (the second time their prefix is cached, so prefill reads the FP8 pool), and write what came back."""
import argparse
import json
import time
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("model", help="model folder with dummy weights, e.g. /tmp/models/dsv3-4l (scripts/make_model.py)")
ap.add_argument("out", type=Path, help="output folder: server.log and smoke.json")
a = ap.parse_args()
if not (Path(a.model) / "config.json").is_file():
    ap.error(f"model {a.model}: no config.json there (make one with scripts/make_model.py)")

from sglang_h20.nightly.serving import Server, output_ids  # noqa: E402

model, out = a.model, a.out
out.mkdir(parents=True, exist_ok=True)
args = ("--load-format dummy --attention-backend h20_fp8_mla --sampling-backend pytorch --moe-runner-backend triton "
        "--fp8-gemm-backend triton --grammar-backend none --mem-fraction-static 0.6 --cuda-graph-max-bs 16").split()
texts = [f"request {i}: " + "the quick brown fox jumps over the lazy dog " * (20 + 30 * i) for i in range(4)]
t0 = time.time()
res = {"model": model, "args": args}
with Server(model, args, out / "server.log") as s:
    res["startup_s"] = round(time.time() - t0, 1)
    first = [output_ids(r) for r in s.generate_batch(texts, max_new_tokens=32)]
    again = [output_ids(r) for r in s.generate_batch(texts, max_new_tokens=32)]
res["ids"], res["ids_repeat"] = first, again
res["repeat_equal"] = [a == b for a, b in zip(first, again)]
# which decode kernel served (the backend logs its pick once per process; SGLANG_H20_FP8_MLA_KERNEL forces one)
res["decode_kernel_lines"] = [ln.strip() for ln in (out / "server.log").read_text(errors="replace").splitlines()
                              if "decode kernel" in ln]
(out / "smoke.json").write_text(json.dumps(res, indent=1))
print(json.dumps({k: res[k] for k in ("startup_s", "repeat_equal", "decode_kernel_lines")}), [len(x) for x in first])
