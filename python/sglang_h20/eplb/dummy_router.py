"""dummy_router: a dummy model's router with co-activation structure (benchmarks of expert placement only).

`--load-format dummy` fills every weight with small uniform noise, so the router picks its top-k experts with no
co-activation structure: nothing for an affinity placement to exploit (remote share 0.505 against upstream's
0.500 in EP-2 servers). With SGLANG_H20_DUMMY_ROUTER_CLUSTERS=S, after a dummy load every MoE layer's gate is
rewritten so that experts come in clusters of S (a seeded random partition per layer, the same on every rank):
expert e's gate row is g * (u_c + 0.1 * n_e), u_c a random unit direction of its cluster c and n_e one of its own,
and the correction bias is zeroed. A token's scores then follow its projection on the cluster directions, so its
top-k lie in one or two clusters, as a trained router's co-activated experts do. `g` sets the spread of those
projections to a few units: the gate's input is the layer's RMSNorm output, whose projection on a unit direction
has about the norm weight's RMS as its scale.

Only `DummyModelLoader.load_model` is hooked: a real checkpoint is never touched.
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from sglang_h20.features import Hook, Unsupported

log = logging.getLogger("sglang_h20")

TARGET = "sglang.srt.model_loader.loader.DummyModelLoader.load_model"
SEED = 20261130
SPREAD = 2.0      # std of a token's logit for a cluster (g * projection)
OWN_NOISE = 0.1   # an expert's own direction, relative to its cluster's: the order inside a cluster


def hooks(settings) -> list[Hook]:
    size = settings["dummy_router_clusters"]
    if size < 2:
        raise Unsupported(f"cluster size {size}: needs at least 2 experts per cluster")
    return [Hook(TARGET, lambda model, *a, **k: cluster_gates(model, size), "after")]


def clusters(num_experts: int, size: int, layer: int) -> np.ndarray:
    """Cluster of every expert of `layer`: a seeded random partition into groups of `size` (every rank draws the
    same one)."""
    if num_experts % size:
        raise ValueError(f"{num_experts} experts do not split into clusters of {size}")
    perm = np.random.default_rng([SEED, layer]).permutation(num_experts)
    out = np.empty(num_experts, dtype=np.int64)
    out[perm] = np.arange(num_experts) // size
    return out


def clustered_rows(num_experts: int, hidden: int, size: int, layer: int, scale: float) -> torch.Tensor:
    """[num_experts, hidden] float32 gate rows: scale * (cluster direction + OWN_NOISE * own direction)."""
    g = torch.Generator().manual_seed(SEED * 1000 + layer)
    unit = lambda n: torch.nn.functional.normalize(torch.randn(n, hidden, generator=g), dim=1)
    dirs, own = unit(num_experts // size), unit(num_experts)
    return scale * (dirs[torch.from_numpy(clusters(num_experts, size, layer))] + OWN_NOISE * own)


def cluster_gates(model: torch.nn.Module, size: int) -> None:
    """AFTER DummyModelLoader.load_model: every MoEGate of `model` rewritten in place (see the module docstring);
    a layer that does not fit is left as loaded, with one line."""
    done, skipped = [], []
    for name, gate in model.named_modules():
        if type(gate).__name__ != "MoEGate":
            continue
        layer = int(name.split("layers.")[1].split(".")[0]) if "layers." in name else len(done)
        num_experts, hidden = gate.weight.shape
        if num_experts % size:
            skipped.append(f"{name}: {num_experts} experts")
            continue
        norm = _input_norm(model, name)
        rms = float(norm.detach().float().pow(2).mean().sqrt()) if norm is not None else 0.0
        scale = SPREAD / rms if rms > 0 else SPREAD * hidden ** 0.5
        with torch.no_grad():
            gate.weight.copy_(clustered_rows(num_experts, hidden, size, layer, scale).to(gate.weight))
            bias = getattr(gate, "e_score_correction_bias", None)
            if bias is not None:
                bias.zero_()
        done.append(layer)
    if done or skipped:
        log.info("dummy_router: %d MoE gates clustered in groups of %d (layers %s)%s", len(done), size, done,
                 f"; left as loaded: {', '.join(skipped)}" if skipped else "")
    return None


def _input_norm(model: torch.nn.Module, gate_name: str):
    """The weight of the RMSNorm whose output the gate reads (the decoder layer's post_attention_layernorm)."""
    layer_name = gate_name.rsplit(".mlp.", 1)[0]
    try:
        return model.get_submodule(layer_name).post_attention_layernorm.weight
    except AttributeError:
        return None
