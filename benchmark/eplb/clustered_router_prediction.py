#!/usr/bin/env python3
"""What an EP server on one node should show with the clustered dummy router, predicted on the CPU.

SGLang's own MoEGate (filled as its dummy loader fills weights, then rewritten by sglang_h20.eplb.dummy_router) and
its grouped top-k route random gate inputs shaped as the layer's RMSNorm makes them; the first half of the tokens
is what the placements learn from, the second half is scored. Tokens' DP ranks alternate (a DP rank does not depend
on a token's experts). Per placement (SGLang's deepseek, ours, SGLang's trivial start) it reports the share of
tokens that leave their GPU, the share of (token, expert) pairs on another GPU, and the GPU load balance.
A prediction on synthetic routing (256 experts, a 512-wide gate input), not a server measurement.

usage: clustered_router_prediction.py [--gpus 2] [--cluster-size 8] [--tokens 3000] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import types
from pathlib import Path

import numpy as np
import torch

from sglang_h20 import provenance
from sglang_h20.cliargs import int_at_least, positive_int
from sglang_h20.eplb import dummy_router
from sglang_h20.eplb.placement import Topology, place
from sglang_h20.eplb.simulate import choose_slots, coactivation, trivial_placement

E, HIDDEN, TOPK, GROUPS, TOPK_GROUPS = 256, 512, 8, 8, 4  # DeepSeek-V3's routing, a narrow hidden size


def dummy_model(layers=(1, 2)) -> torch.nn.Module:
    """Decoder layers holding SGLang's real MoEGate and a norm, filled as SGLang's dummy loader fills weights."""
    from sglang.srt.models.deepseek_v2 import MoEGate

    cfg = types.SimpleNamespace(n_routed_experts=E, hidden_size=HIDDEN, topk_method="noaux_tc",
                                architectures=["DeepseekV3ForCausalLM"])
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList()
    for i in range(max(layers) + 1):
        layer = torch.nn.Module()
        layer.post_attention_layernorm = torch.nn.Module()
        layer.post_attention_layernorm.weight = torch.nn.Parameter(torch.rand(HIDDEN, generator=g) * 2e-3 - 1e-3)
        if i in layers:
            layer.mlp = torch.nn.Module()
            layer.mlp.gate = MoEGate(cfg, None, prefix=f"layers.{i}.mlp.gate")
            with torch.no_grad():
                for p in layer.mlp.gate.parameters():
                    p.copy_(torch.rand(p.shape, generator=g) * 2e-3 - 1e-3)
        model.layers.append(layer)
    return model


def route(model, layer: int, tokens: int = 2000) -> torch.Tensor:
    """[tokens, TOPK] experts SGLang's biased grouped top-k picks for gate inputs as the layer's RMSNorm makes them."""
    from sglang.srt.layers.moe.topk import biased_grouped_topk_impl

    gate = model.layers[layer].mlp.gate
    z = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(layer))
    h = z * model.layers[layer].post_attention_layernorm.weight.detach()
    logits = h @ gate.weight.detach().T
    _, ids = biased_grouped_topk_impl(h, logits, gate.e_score_correction_bias.detach(), TOPK, True, GROUPS,
                                      TOPK_GROUPS)
    return ids


def predict(gpus: int = 2, cluster_size: int = 8, tokens: int = 3000, layers=(1, 2, 3)) -> dict:
    """Per placement: tokens leaving their GPU, pairs on another GPU, min over layers of min/max GPU load."""
    model = dummy_model(layers)
    dummy_router.cluster_gates(model, cluster_size)
    ids = np.stack([route(model, l, tokens).numpy() for l in layers])  # [L, T, K]
    half = tokens // 2
    stats, test = coactivation([ids[:, :half]], E), ids[:, half:]
    topo = Topology(1, gpus, E // gpus)
    origin = np.arange(test.shape[1]) % gpus
    placements = {alg: place(stats, topo, alg) for alg in ("deepseek", "affinity")}
    placements["trivial"] = trivial_placement(topo, len(layers), E)
    return {name: placement_shares(topo.slot_gpu()[choose_slots(p, test, np.zeros(test.shape[1], dtype=np.int64))],
                                   origin, gpus)
            for name, p in placements.items()}


def placement_shares(gpu: np.ndarray, origin: np.ndarray, gpus: int) -> dict:
    """gpu[l, t, k]: the GPU serving token t's k-th expert in layer l; origin[t]: the token's own GPU (its DP rank).
    The share of (layer, token)s with an expert elsewhere (the issue's tokens that leave their GPU), the share of
    (token, expert) pairs elsewhere, and the least min/max GPU load over the layers."""
    remote = gpu != origin[None, :, None]
    load = np.stack([np.bincount(gpu[l].ravel(), minlength=gpus) for l in range(gpu.shape[0])])
    return {"token_leave_share": float(remote.any(axis=2).mean()), "pair_remote_share": float(remote.mean()),
            "gpu_balance_min": float((load.min(axis=1) / load.max(axis=1)).min())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int_at_least(2), default=2, help="GPUs of the node (default: %(default)s)")
    ap.add_argument("--cluster-size", type=int_at_least(2), default=8,
                    help="experts per cluster (default: %(default)s)")
    ap.add_argument("--tokens", type=positive_int, default=3000, help="tokens routed per layer (default: %(default)s)")
    ap.add_argument("--out", type=Path, help="write the record as JSON here (default: print only)")
    a = ap.parse_args()
    if a.out and not a.out.parent.is_dir():
        ap.error(f"--out {a.out}: no such directory: {a.out.parent}")
    res = predict(a.gpus, a.cluster_size, a.tokens)
    for name, r in res.items():
        print(f"{name:9s} tokens leaving their GPU {r['token_leave_share']:.3f}, pairs on another GPU "
              f"{r['pair_remote_share']:.3f}, GPU balance >= {r['gpu_balance_min']:.2f}")
    record = {**provenance.record(), "benchmark": "eplb_clustered_router_prediction", "kind": "CPU prediction",
              "gpus": a.gpus, "cluster_size": a.cluster_size, "tokens": a.tokens, "experts": E,
              "gate_input_width": HIDDEN, "placements": res,
              "token_leave_affinity_over_deepseek": res["affinity"]["token_leave_share"]
              / res["deepseek"]["token_leave_share"]}
    if a.out:
        a.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
