"""The clustered dummy router (sglang_h20.eplb.dummy_router): after a dummy load, SGLang's own MoEGate routes a
token's top-k into one or two clusters through SGLang's own grouped top-k, the clusters spread the load, and every
rank draws the same gates. Without it the dummy router co-activates nothing (the 0.505 vs 0.500 remote share of the
EP-2 servers), so these are what make an affinity placement measurable there."""
from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from sglang_h20.eplb import dummy_router
from sglang_h20.features import FEATURES, Unsupported, decide
from sglang_h20.settings import Settings

E, HIDDEN, TOPK, GROUPS, TOPK_GROUPS, SIZE = 256, 512, 8, 8, 4, 8  # DeepSeek-V3's routing, a narrow hidden size


def dummy_model(layers=(1, 2)):
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


def clusters_per_token(ids: torch.Tensor, layer: int) -> np.ndarray:
    c = dummy_router.clusters(E, SIZE, layer)
    return np.array([len(set(c[row])) for row in ids.numpy()])


def test_partition_is_seeded_per_layer_and_exact():
    a, b = dummy_router.clusters(E, SIZE, 1), dummy_router.clusters(E, SIZE, 1)
    assert (a == b).all() and not (a == dummy_router.clusters(E, SIZE, 2)).all()
    assert sorted(np.bincount(a)) == [SIZE] * (E // SIZE)
    with pytest.raises(ValueError, match="clusters of 7"):
        dummy_router.clusters(E, 7, 1)


def test_clustered_gates_co_activate_and_spread_the_load():
    model = dummy_model()
    before = {l: clusters_per_token(route(model, l), l) for l in (1, 2)}
    dummy_router.cluster_gates(model, SIZE)
    for l in (1, 2):
        ids = route(model, l)
        spans = clusters_per_token(ids, l)
        # a token's 8 experts: one or two clusters for most tokens (0.83 here; the group limit of the grouped top-k
        # keeps part of a cluster out), where the dummy router gives every token the same 7-8 clusters (its
        # correction bias outweighs its tiny logits)
        assert (spans <= 2).mean() >= 0.7 and spans.mean() <= 2.5, spans.mean()
        assert before[l].mean() >= 6.5, before[l].mean()
        # ... and the tokens use every cluster, none for more than a few times its share
        top = np.bincount(dummy_router.clusters(E, SIZE, l)[ids[:, 0].numpy()], minlength=E // SIZE)
        assert (top > 0).all() and top.max() <= 4 * len(ids) / (E // SIZE)
        assert torch.count_nonzero(model.layers[l].mlp.gate.e_score_correction_bias) == 0


def test_every_rank_draws_the_same_gates_and_other_modules_are_untouched():
    a, b = dummy_model(), dummy_model()
    norm = a.layers[0].post_attention_layernorm.weight.detach().clone()
    dummy_router.cluster_gates(a, SIZE)
    dummy_router.cluster_gates(b, SIZE)
    assert all(torch.equal(a.layers[l].mlp.gate.weight, b.layers[l].mlp.gate.weight) for l in (1, 2))
    assert torch.equal(a.layers[0].post_attention_layernorm.weight, norm)


def test_layer_that_does_not_split_is_left_as_loaded(caplog):
    model = dummy_model(layers=(1,))
    w = model.layers[1].mlp.gate.weight.detach().clone()
    dummy_router.cluster_gates(model, 12)  # 256 experts do not split into 12s
    assert torch.equal(model.layers[1].mlp.gate.weight, w)


def test_switch_turns_the_feature_on_with_the_dummy_loader_hook_only():
    feature = next(f for f in FEATURES if f.name == "dummy_router")
    off = decide(feature, Settings.from_env({}))
    assert not off.on and "SGLANG_H20_DUMMY_ROUTER_CLUSTERS=0" in off.reason
    on = decide(feature, Settings.from_env({"SGLANG_H20_DUMMY_ROUTER_CLUSTERS": "8"}))
    assert on.on, on.reason
    assert [h.target for h in on.hooks] == [dummy_router.TARGET]
    bad = decide(feature, Settings.from_env({"SGLANG_H20_DUMMY_ROUTER_CLUSTERS": "eight"}))
    assert not bad.on and "bad value" in bad.reason
    with pytest.raises(Unsupported, match="at least 2"):
        dummy_router.hooks({"dummy_router_clusters": 1})


def test_affinity_keeps_clustered_tokens_on_their_gpu_where_deepseek_does_not():
    """What the EP-2 server run is to show, predicted on the CPU: with the clustered router, our placement (GPUs as
    the locality domains of one node) lets fewer tokens leave their GPU than SGLang's deepseek placement, at the
    same load balance; the share of (token, expert) pairs on another GPU stays ~0.5 for both (a token's DP rank
    does not depend on its experts), so that share cannot show it."""
    from sglang_h20.eplb.placement import Topology, place
    from sglang_h20.eplb.simulate import choose_slots, coactivation

    model = dummy_model(layers=(1, 2, 3))
    dummy_router.cluster_gates(model, SIZE)
    ids = np.stack([route(model, l, tokens=3000).numpy() for l in (1, 2, 3)])  # [L, T, K]
    stats, test = coactivation([ids[:, :1500]], E), ids[:, 1500:]
    topo = Topology(1, 2, E // 2)
    origin = np.arange(test.shape[1]) % 2  # DP rank of each token
    out = {}
    for alg in ("deepseek", "affinity"):
        slot = choose_slots(place(stats, topo, alg), test, np.zeros(test.shape[1], dtype=np.int64))
        remote = topo.slot_gpu()[slot] != origin[None, :, None]
        load = np.stack([np.bincount(topo.slot_gpu()[slot[l]].ravel(), minlength=2) for l in range(3)])
        out[alg] = (remote.any(axis=2).mean(), remote.mean(), (load.min(axis=1) / load.max(axis=1)).min())
    assert out["deepseek"][0] >= 0.95 and out["affinity"][0] <= 0.85, out  # tokens leaving their GPU
    assert all(0.45 <= v[1] <= 0.55 for v in out.values()), out           # pairs: no signal either way
    assert out["affinity"][2] >= 0.85, out                                 # GPU load balance kept
