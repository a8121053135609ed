"""The prefill MHA/MLA policy: edge cases, tables, and equivalence with SGLang 0.5.17's own rule.

The equivalence test drives the real upstream `_handle_attention_backend` (installed sglang) and
our AROUND hook around it with the same random batches and constraint flags.
"""
import importlib
import json
import random
from types import SimpleNamespace

import pytest

from sglang_h20 import compat
from sglang_h20.attention import mha_mla
from sglang_h20.attention.mha_mla import BatchShape, CostTable, Forced, UpstreamRule
from sglang_h20.calibrate import fit_table, grid_points, modelled_table, nnls_fit, QUICK_GRID
from sglang_h20.settings import Settings

h = importlib.import_module(mha_mla.HANDLER_MODULE)
M = h.AttnForwardMethod
H200 = modelled_table("NVIDIA H200", 790, 4.3)


@pytest.fixture(autouse=True)
def no_context_parallel(monkeypatch):
    """Upstream's CP check reads the global server args, unset outside a server: CP is off here."""
    monkeypatch.setattr(h, "mla_use_prefill_cp", lambda fb: False)


class Mode:
    def __init__(self, extend_no_spec):
        self._e = extend_no_spec

    def is_extend_without_speculative(self):
        return self._e


def fake(extend, prefix, *, extend_no_spec=True, disable_chunked=False, disable_ragged=False,
         threshold=8192, chunk_capacity=1 << 20):
    attn = SimpleNamespace(chunked_prefix_cache_threshold=threshold, disable_chunked_prefix_cache=disable_chunked,
                           flashinfer_mla_disable_ragged=disable_ragged)
    fb = SimpleNamespace(extend_seq_lens_cpu=list(extend), extend_prefix_lens_cpu=list(prefix),
                         seq_lens_cpu=[e + p for e, p in zip(extend, prefix)], attn_cp_metadata=None,
                         forward_mode=Mode(extend_no_spec), get_max_chunk_capacity=lambda: chunk_capacity)
    return attn, fb


def test_se_counts_extend_times_extend_plus_prefix():
    s = BatchShape([100, 10], [1000, 0])
    assert s.se == 100 * 1100 + 10 * 10
    assert s.features() == {"se": 110100, "prefix": 1000, "extend": 110, "const": 1.0}
    with pytest.raises(ValueError, match="2 extend lengths but 1 prefix"):
        BatchShape([1, 2], [0])


def test_edge_cases_of_the_cost_policy():
    assert H200.choose(BatchShape([], [])) == "mla"  # empty batch
    assert H200.choose(BatchShape([4096], [0])) == "mha"  # no prefix: nothing to expand, MHA is cheaper
    assert H200.choose(BatchShape([1], [0])) == "mha"
    assert H200.choose(BatchShape([16], [65536])) == "mla"  # a few new tokens on a huge prefix
    assert H200.choose(BatchShape([8192], [4096])) == "mha"  # long extend amortizes the expansion
    # one huge prefix among short requests: the expansion of 64k tokens outweighs the short extends
    assert H200.choose(BatchShape([64, 64, 64, 64], [65536, 0, 0, 0])) == "mla"
    # mixed batch where the long fresh prompts dominate se
    assert H200.choose(BatchShape([8192, 8192, 32], [0, 0, 8192])) == "mha"


def test_costs_grow_with_work():
    base = BatchShape([1024], [4096])
    for m in ("mha", "mla"):
        assert H200.cost(m, BatchShape([2048], [4096])) > H200.cost(m, base)
    assert H200.cost("mha", BatchShape([1024], [8192])) > H200.cost("mha", base)


@pytest.mark.parametrize("name", ["NVIDIA H20", "NVIDIA H200"])
def test_shipped_tables_load_and_say_where_they_come_from(name):
    t = mha_mla.load_table(name)
    assert t.gpu == name
    assert t.source.startswith(("measured on", "modelled"))
    assert t.meta["measured"] is t.source.startswith("measured on")
    assert "provenance" in t.meta and t.meta["provenance"]["date"]
    if t.meta["measured"]:
        assert t.meta["provenance"]["gpu"] == name  # measured on the GPU it is for
    assert t.choose(BatchShape([8], [65536])) == "mla"  # a few new tokens on a huge prefix


def test_h20_table_is_labelled_modelled_until_an_h20_run():
    t = mha_mla.load_table("NVIDIA H20")
    assert not t.meta["measured"] and "modelled" in t.source


def test_unknown_gpu_gets_a_clear_error():
    with pytest.raises(FileNotFoundError, match="no MHA/MLA cost table for 'NVIDIA A100-SXM4-80GB'.*calibrate mha-mla"):
        mha_mla.load_table("NVIDIA A100-SXM4-80GB")


def test_table_round_trips_and_rejects_unknown_terms():
    t = CostTable.from_json(json.loads(json.dumps(H200.to_json())))
    assert t.mha == H200.mha and t.mla == H200.mla
    bad = {**H200.to_json(), "mha": {**H200.mha, "tokens": 1.0}}
    with pytest.raises(ValueError, match="unknown mha terms"):
        CostTable.from_json(bad)


def test_upstream_rule_matches_the_documented_threshold():
    r = UpstreamRule()
    assert r.choose(BatchShape([10, 10], [0, 0])) == "mha"
    assert r.choose(BatchShape([10, 10], [4000, 4191])) == "mla"
    assert r.choose(BatchShape([10, 10], [4000, 4192])) == "mha"


def _router(policy):
    return mha_mla.make_router(policy)


def test_equals_upstream_on_thousands_of_random_batches_with_its_threshold():
    """With upstream's single threshold as the table, our hook returns exactly what SGLang returns."""
    rng = random.Random(7)
    original = h._handle_attention_backend
    route = _router(UpstreamRule(8192))
    seen = set()
    for _ in range(5000):
        n = rng.randint(1, 16)
        extend = [rng.choice([1, 7, 128, 1000, 4096, 16384]) for _ in range(n)]
        prefix = [rng.choice([0, 0, 1, 100, 2048, 8191, 8192, 65536]) for _ in range(n)]
        kw = dict(extend_no_spec=rng.random() < 0.85, disable_chunked=rng.random() < 0.15,
                  disable_ragged=rng.random() < 0.1, chunk_capacity=rng.choice([4096, 1 << 20]))
        backend = rng.choice(["fa3", "flashinfer", "flashmla", "cutlass_mla"])
        attn, fb = fake(extend, prefix, **kw)
        want = original(attn, fb, backend)
        got = route(original, attn, fb, backend)
        assert got == want, (extend, prefix, kw, backend)
        seen.add(want)
    assert {M.MHA_ONE_SHOT, M.MHA_CHUNKED_KV, M.MLA} <= seen  # every branch was exercised


def test_constraints_upstream_respects_keep_upstreams_answer(monkeypatch):
    route = _router(Forced("mha"))
    original = h._handle_attention_backend
    # speculative verify / draft extend: MLA
    attn, fb = fake([4], [5000], extend_no_spec=False)
    assert route(original, attn, fb, "flashmla") == M.MLA
    # backends that plan without ragged prefill
    attn, fb = fake([4096], [5000], disable_ragged=True)
    assert route(original, attn, fb, "flashinfer") == M.MLA
    # chunked prefix cache disabled and a prefix present
    attn, fb = fake([4096], [5000], disable_chunked=True)
    assert route(original, attn, fb, "fa3") == M.MLA
    # captured prefill
    monkeypatch.setattr(h, "is_in_tc_piecewise_cuda_graph", lambda: True)
    attn, fb = fake([4096], [0])
    assert route(original, attn, fb, "fa3") == M.MLA
    monkeypatch.setattr(h, "is_in_tc_piecewise_cuda_graph", lambda: False)
    # context-parallel prefill
    monkeypatch.setattr(h, "mla_use_prefill_cp", lambda fb: True)
    assert route(original, attn, fb, "fa3") == M.MLA


def test_policy_changes_the_choice_where_upstream_is_free():
    original = h._handle_attention_backend
    route = _router(H200)
    attn, fb = fake([4096], [2048])  # upstream: prefix 2048 < 8192 -> MLA
    assert original(attn, fb, "flashmla") == M.MLA
    assert route(original, attn, fb, "flashmla") == M.MHA_ONE_SHOT
    attn, fb = fake([4096], [2048], chunk_capacity=1024)  # too long for one shot
    assert route(original, attn, fb, "flashmla") == M.MHA_CHUNKED_KV
    attn, fb = fake([8], [9000])  # upstream: prefix >= 8192 -> MHA; 8 new tokens do not pay for expanding 9000
    assert original(attn, fb, "flashmla") in (M.MHA_ONE_SHOT, M.MHA_CHUNKED_KV)
    assert route(original, attn, fb, "flashmla") == M.MLA


def test_hook_target_resolves_and_policy_follows_the_switch(monkeypatch):
    assert compat.check_target(mha_mla.TARGET) == (True, mha_mla.TARGET)
    monkeypatch.setattr(compat, "gpu", lambda: compat.Gpu("NVIDIA H200", (9, 0), 140.0))
    for value, kind in (("se", CostTable), ("mha", Forced), ("mla", Forced)):
        (hook,) = mha_mla.hooks(Settings.from_env({"SGLANG_H20_MHA_MLA_POLICY": value}))
        assert hook.target == mha_mla.TARGET and hook.kind == "around"
        assert isinstance(hook.fn.policy, kind)


def test_nnls_fit_recovers_known_coefficients():
    rng = random.Random(3)
    truth = {"se": 2e-6, "prefix": 0.05, "extend": 0.01, "const": 30.0}
    rows = [BatchShape([e] * b, [p] * b).features() for b, e, p in grid_points(QUICK_GRID)]
    times = [sum(truth[k] * r[k] for k in truth) * (1 + 0.001 * rng.uniform(-1, 1)) for r in rows]
    fit = nnls_fit(rows, times)
    for k in truth:
        assert fit[k] == pytest.approx(truth[k], rel=0.05), k
    assert all(v >= 0 for v in nnls_fit(rows, [-t for t in times]).values())


def test_fit_table_reports_the_loss_of_its_own_choice():
    pts = [{"batch": b, "extend": e, "prefix": p} for b, e, p in grid_points(QUICK_GRID)]
    for p in pts:
        s = BatchShape([p["extend"]] * p["batch"], [p["prefix"]] * p["batch"])
        p["mha_us"], p["mla_us"] = H200.cost("mha", s), H200.cost("mla", s)
    t = fit_table("NVIDIA H200", pts, {})
    assert t.meta["measured"] and t.source == "measured on NVIDIA H200"
    assert max(p["loss_vs_best_pct"] for p in pts) < 1.0
    t8 = fit_table("NVIDIA H200", pts, {}, layers=8)  # per-layer coefficients from an 8-layer model
    for m in ("mha", "mla"):
        for term, v in getattr(t, m).items():
            assert getattr(t8, m)[term] == pytest.approx(v / 8, rel=1e-9, abs=1e-12)
