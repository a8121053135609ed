#!/usr/bin/env python3
"""Does the FP8 KV format need its second scale? One e4m3 scale per token (latent and rope together) against the
shipped two (latent, rope), in the attention output, on the CPU in float64.

Why it matters: with one scale, QKᵀ needs one accumulator instead of two (latent and rope carry different scales),
which frees 32 registers per thread in the CUDA v2 kernel: the room it lacked to overlap the V transposes with the
QKᵀ wgmmas (ptxas spilled when they overlapped). This measures only the numerics, not speed.

Per point: the largest relative error, over `--seeds` draws of one sequence at `--tokens` x 128 heads, of
softmax(q kᵀ / sqrt(192)) v with q and k quantized (v is k's latent part) against the same in float64 on the bf16
inputs. Inputs: `make_mla_inputs` (DeepSeek-like latent with outlier channels, or i.i.d.), rope std swept.

usage: python benchmark/kernels/kv_scale_numerics.py [--tokens 4096] [--seeds 4] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2] / d) for d in ("python", "sgl-kernel-ext")]
from sgl_kernel_ext import mla_decode as mla  # noqa: E402
from sglang_h20 import provenance  # noqa: E402

INPUTS = {"deepseek-like": dict(shared=1.0, outlier_gains=(10.0, 15.0, 20.0, 25.0, 30.0)),
          "iid": dict(shared=0.0, outlier_gains=())}


def one_scale(x: torch.Tensor) -> torch.Tensor:
    """x quantized to e4m3 with one amax/448 scale over its last dim (the format's own rule, applied to all 576
    channels at once), dequantized."""
    q, s = mla._quant_part(x)
    return q.float() * s


def two_scales(x: torch.Tensor) -> torch.Tensor:
    """The shipped format: latent and rope channels on their own scales."""
    return mla.dequantize_kv_fp8(*mla.quantize_kv_fp8(x))


def attend(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    p = torch.softmax((q @ k.T) / 192 ** 0.5, dim=-1)
    return p @ k[:, :mla.KV_LORA_RANK]


def max_errors(tokens: int, seeds: int, rope_std: float, kind: str) -> dict:
    errs: dict = {"two_scales": [], "one_scale": []}
    for seed in range(seeds):
        d = mla.make_mla_inputs([tokens], 128, rope_std=rope_std, poison=False, seed=seed, **INPUTS[kind])
        k = d["latent_cache"][d["block_table"][0].long()].reshape(-1, mla.HEAD_DIM_QK)[:tokens].double()
        q = d["q"][0, 0].double()
        ref = attend(q, k)
        for name, quant in (("two_scales", two_scales), ("one_scale", one_scale)):
            out = attend(quant(q.float()).double(), quant(k.float()).double())
            errs[name].append(((out - ref).norm() / ref.norm()).item())
    return {name: max(v) for name, v in errs.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="context length (default: %(default)s)")
    ap.add_argument("--seeds", type=int, default=4, help="draws per point (default: %(default)s)")
    ap.add_argument("--rope-std", type=float, nargs="+", default=[0.02, 0.2, 2.0, 20.0],
                    help="rope channels' std; the latent is RMS-normalised (default: %(default)s)")
    ap.add_argument("--json", type=Path, help="write the record here")
    args = ap.parse_args()
    points = []
    for rope_std in args.rope_std:
        for kind in INPUTS:
            e = max_errors(args.tokens, args.seeds, rope_std, kind)
            points.append({"rope_std": rope_std, "inputs": kind, **e})
            print(f"rope std {rope_std:6}: {kind:13} largest relative error, two scales {e['two_scales']:.3%}, "
                  f"one scale {e['one_scale']:.3%}", flush=True)
    if args.json:
        record = {**provenance.record(), "benchmark": "kv_scale_numerics", "device": "cpu (float64 reference)",
                  "tokens": args.tokens, "heads": 128, "seeds": args.seeds, "points": points}
        args.json.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
