"""The clustered dummy router (sglang_h20.eplb.dummy_router): after a dummy load, SGLang's own MoEGate routes a
token's top-k into one or two clusters through SGLang's own grouped top-k, the clusters spread the load, and every
rank draws the same gates. Without it the dummy router co-activates nothing (the 0.505 vs 0.500 remote share of the
EP-2 servers), so these are what make an affinity placement measurable there."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from sglang_h20.eplb import dummy_router
from sglang_h20.features import FEATURES, Unsupported, decide
from sglang_h20.settings import Settings

from repo_scripts import load_script

prediction = load_script("benchmark/eplb/clustered_router_prediction.py")
dummy_model, route = prediction.dummy_model, prediction.route  # SGLang's MoEGate and grouped top-k, dummy-filled
E, SIZE = prediction.E, 8


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


def test_every_rank_draws_the_same_gates_and_other_modules_are_untouched(caplog):
    a, b = dummy_model(), dummy_model()
    norm = a.layers[0].post_attention_layernorm.weight.detach().clone()
    with caplog.at_level("INFO", logger="sglang_h20"):
        dummy_router.cluster_gates(a, SIZE)
    # one line per load, naming the layers rewritten (the server log's only sign that the router is clustered)
    assert [r.getMessage() for r in caplog.records if "dummy_router" in r.getMessage()] == [
        "dummy_router: 2 MoE gates clustered in groups of 8 (layers [1, 2])"]
    dummy_router.cluster_gates(b, SIZE)
    assert all(torch.equal(a.layers[l].mlp.gate.weight, b.layers[l].mlp.gate.weight) for l in (1, 2))
    assert torch.equal(a.layers[0].post_attention_layernorm.weight, norm)


def test_gate_rows_are_scaled_by_the_input_norms_rms():
    """Row norm = g * |u_c + 0.1 n_e| ~ g * sqrt(1.01) (u_c, n_e near-orthogonal units), g = SPREAD / rms(norm weight);
    a norm weight of zeros (rms 0) takes g = SPREAD * sqrt(hidden) instead of dividing by it."""
    model = dummy_model()
    norm = model.layers[1].post_attention_layernorm.weight
    rms = float(norm.detach().pow(2).mean().sqrt())
    with torch.no_grad():
        model.layers[2].post_attention_layernorm.weight.zero_()
    dummy_router.cluster_gates(model, SIZE)
    hidden = norm.numel()
    for layer, g in ((1, dummy_router.SPREAD / rms), (2, dummy_router.SPREAD * hidden ** 0.5)):
        rows = model.layers[layer].mlp.gate.weight.detach().float().norm(dim=1) / g
        assert ((rows - (1 + dummy_router.OWN_NOISE ** 2) ** 0.5).abs() < 0.02).all(), (layer, rows.min(), rows.max())


def test_layer_that_does_not_split_is_left_as_loaded(caplog):
    model = dummy_model(layers=(1,))
    w = model.layers[1].mlp.gate.weight.detach().clone()
    with caplog.at_level("INFO", logger="sglang_h20"):
        dummy_router.cluster_gates(model, 12)  # 256 experts do not split into 12s
    assert torch.equal(model.layers[1].mlp.gate.weight, w)
    assert "0 MoE gates clustered in groups of 12 (layers []); left as loaded: layers.1.mlp.gate: 256 experts" in \
        caplog.text, caplog.text


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
    assert [h.target for h in dummy_router.hooks({"dummy_router_clusters": 2})] == [dummy_router.TARGET]  # pairs


def test_affinity_keeps_clustered_tokens_on_their_gpu_where_deepseek_does_not(tmp_path, monkeypatch):
    """What the EP-2 server run is to show, predicted on the CPU (benchmark/eplb/clustered_router_prediction.py):
    with the clustered router, our placement (GPUs as the locality domains of one node) lets fewer tokens leave
    their GPU than SGLang's deepseek placement, at the same load balance; the share of (token, expert) pairs on
    another GPU stays ~0.5 for both (a token's DP rank does not depend on its experts), so that share cannot show
    it. The script's record carries the ratio."""
    import json
    import sys

    out = tmp_path / "p.json"
    monkeypatch.setattr(sys, "argv", ["clustered_router_prediction.py", "--out", str(out)])
    prediction.main()
    rec = json.loads(out.read_text())
    res = rec["placements"]
    assert res["deepseek"]["token_leave_share"] >= 0.95 and res["affinity"]["token_leave_share"] <= 0.85, res
    assert all(0.45 <= v["pair_remote_share"] <= 0.55 for v in res.values()), res  # pairs: no signal either way
    assert res["affinity"]["gpu_balance_min"] >= 0.85, res                          # GPU load balance kept
    assert rec["token_leave_affinity_over_deepseek"] < 0.9 and rec["kind"] == "CPU prediction"


def test_placement_shares_count_tokens_that_leave_and_pairs_elsewhere():
    """A worked case, 2 GPUs, 2 layers, 3 tokens of 2 experts (origins 0, 1, 0): layer 0 keeps token 0 home, sends
    one of token 1's experts away and both of token 2's; layer 1 keeps every expert home but loads GPU 0 with 4 of 6."""
    gpu = np.array([[[0, 0], [0, 1], [1, 1]],
                    [[0, 0], [1, 1], [0, 0]]])
    got = prediction.placement_shares(gpu, np.array([0, 1, 0]), 2)
    assert got == pytest.approx({"token_leave_share": 2 / 6, "pair_remote_share": 3 / 12,
                                 "gpu_balance_min": 2 / 4})
    lopsided = prediction.placement_shares(np.array([[[0, 0], [0, 0], [0, 1]]]), np.array([0, 1, 0]), 2)
    assert lopsided == pytest.approx({"token_leave_share": 2 / 3, "pair_remote_share": 3 / 6,
                                      "gpu_balance_min": 1 / 5})
