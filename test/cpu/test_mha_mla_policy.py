"""The prefill MHA/MLA policy: edge cases, tables, and equivalence with SGLang 0.5.17's own rule.

The equivalence test drives the real upstream `_handle_attention_backend` (installed sglang) and
our AROUND hook around it with the same random batches and constraint flags.
"""
import importlib
import json
import math
import os
import random
from types import SimpleNamespace

import pytest

from sglang_h20 import compat
from sglang_h20.attention import mha_mla
from sglang_h20.attention.mha_mla import BatchShape, CostTable, Forced, UpstreamRule
from sglang_h20.calibrate import MAX_POINT_TOKENS, fit_table, grid_points, modelled_table, nnls_fit, QUICK_GRID
from sglang_h20.settings import Settings

from repo_scripts import REPO, load_script

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


@pytest.mark.parametrize("name", ["NVIDIA H20", "NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_shipped_tables_load_and_say_where_they_come_from(name):
    t = mha_mla.load_table(name)
    assert t.gpu == name
    assert t.source.startswith(("measured on", "modelled"))
    assert t.meta["measured"] is t.source.startswith("measured on")
    assert "provenance" in t.meta and t.meta["provenance"]["date"]
    if t.meta["measured"]:
        assert t.meta["provenance"]["gpu"] == name  # measured on the GPU it is for
    assert t.choose(BatchShape([8], [65536])) == "mla"  # a few new tokens on a huge prefix


def test_h100_table_is_session_57s_grid_with_session_58s_overhead():
    """The H100's table: `calibrate mha-mla --grid full` on an H100 (session 57), shipped as written; its fit loses
    nothing on its own grid, where SGLang's prefix-only rule loses up to 389%. Session 58 added the once-per-prefill
    MHA overhead from `prefix_ttft.py --one-server --arms mla mha --fit-overhead` on the same card: the value is
    what fit_mha_prefix_overhead gives on that run's recorded medians with this table's per-layer costs."""
    t = mha_mla.load_table("NVIDIA H100 80GB HBM3")
    prov = t.meta["provenance"]
    assert prov["gpu"] == "NVIDIA H100 80GB HBM3" and "--grid full" in prov["command"]
    assert prov["date"].startswith("2026-12-05")
    assert t.meta["fit"]["in_sample_worst_loss_pct"] < 1.0 < t.meta["fit"]["upstream_worst_loss_pct"]
    over = t.meta["mha_prefix_overhead"]
    run = json.loads((REPO / over["fitted_from"][0]).read_text())
    assert run["gpu"] == over["gpu"] == "NVIDIA H100 80GB HBM3" and "--fit-overhead" in run["command"]
    samples = load_script("benchmark/serving/prefix_ttft.py").overhead_samples(run["one_server"])
    assert over["layers"] == 4  # dsv3-4l's, the model the run served
    fit = mha_mla.fit_mha_prefix_overhead(t, samples, over["layers"])
    assert len(samples) == 3 and t.mha_prefix_overhead_us == pytest.approx(fit["mha_prefix_overhead_us"], abs=0.1)
    assert over["values_us"] == [round(v) for v in fit["values_us"]] and 2000 < t.mha_prefix_overhead_us < 6000
    assert t.choose(BatchShape([1024], [1024])) == "mha" and t.choose(BatchShape([128], [8192])) == "mla"


def test_h20_table_is_labelled_modelled_until_an_h20_run():
    t = mha_mla.load_table("NVIDIA H20")
    assert not t.meta["measured"] and "modelled" in t.source


def test_h20_table_is_what_its_command_models():
    """The shipped H20 table is `calibrate mha-mla-model --gpu 'NVIDIA H20' --bf16-tflops 148 --hbm-tbs 4.0`, term
    for term: a change to the model's FLOP or byte counts shows here."""
    t = mha_mla.load_table("NVIDIA H20")
    assert "--bf16-tflops 148 --hbm-tbs 4.0" in t.meta["provenance"]["command"]
    m = modelled_table("NVIDIA H20", 148, 4.0)
    assert m.source == t.source
    for method in ("mha", "mla"):
        assert getattr(m, method) == pytest.approx(getattr(t, method), rel=1e-12), method


def test_unknown_gpu_gets_a_clear_error():
    with pytest.raises(FileNotFoundError, match="no MHA/MLA cost table for 'NVIDIA A100-SXM4-80GB'.*calibrate mha-mla"):
        mha_mla.load_table("NVIDIA A100-SXM4-80GB")


def test_table_round_trips_and_rejects_unknown_terms():
    t = CostTable.from_json(json.loads(json.dumps(H200.to_json())))
    assert t.mha == H200.mha and t.mla == H200.mla
    bad = {**H200.to_json(), "mha": {**H200.mha, "tokens": 1.0}}
    with pytest.raises(ValueError, match="unknown mha terms"):
        CostTable.from_json(bad)


def test_prefix_overhead_is_charged_once_per_prefill_against_the_layers_gain():
    """A 4-layer model gains 4x the per-layer difference by taking MHA, a 61-layer one 61x; the once-per-prefill
    MHA cost decides only the first. Without a layer count (layer-level view) it is not charged."""
    t = CostTable.from_json({**H200.to_json(), "mha_prefix_overhead_us": 4400.0})
    assert t.mha_prefix_overhead_us == 4400.0 and CostTable.from_json(t.to_json()) == t
    small, big = BatchShape([512], [512]), BatchShape([2048] * 8, [2048] * 8)
    gain = t.cost("mla", small) - t.cost("mha", small)
    assert 0 < 4 * gain < 4400 < 61 * gain  # the H200-like numbers this was built for
    assert t.choose(small) == "mha" and t.choose(small, 61) == "mha" and t.choose(small, 4) == "mla"
    assert t.choose(big, 4) == "mha"
    assert t.choose(BatchShape([512], [0]), 4) == H200.choose(BatchShape([512], [0]))  # no prefix: no charge
    assert t.prefill_cost("mha", small, 4) == pytest.approx(4 * t.cost("mha", small) + 4400.0)
    assert t.prefill_cost("mla", small, 4) == pytest.approx(4 * t.cost("mla", small))
    assert UpstreamRule().choose(small, 4) == UpstreamRule().choose(small) and Forced("mha").choose(small, 4) == "mha"


def test_fit_of_the_prefix_overhead_takes_the_median_and_needs_a_prefix():
    s1, s2, s3 = BatchShape([512], [512]), BatchShape([1024], [1024]), BatchShape([2048], [2048])
    gains = [4 * (H200.cost("mla", s) - H200.cost("mha", s)) for s in (s1, s2, s3)]
    # server: MHA - MLA = F - 4 * gain per layer; F = 3000, 5000 (outlier-free median), 9000 us
    samples = [(s, 10.0 + (f - g) / 1e3, 10.0) for s, f, g in zip((s1, s2, s3), (3000, 5000, 9000), gains)]
    fit = mha_mla.fit_mha_prefix_overhead(H200, samples, 4)
    assert fit["mha_prefix_overhead_us"] == pytest.approx(5000, abs=1e-6) and fit["layers"] == 4
    assert fit["values_us"] == pytest.approx([3000, 5000, 9000])
    with pytest.raises(ValueError, match="no cached prefix"):
        mha_mla.fit_mha_prefix_overhead(H200, [(BatchShape([512], [0]), 5.0, 4.0)], 4)


def test_router_passes_the_ranks_attention_layers(monkeypatch):
    from sglang.srt.model_executor import forward_context

    assert mha_mla.attention_layers() is None  # no forward context outside a forward pass
    pool = SimpleNamespace(layer_num=4)
    monkeypatch.setattr(forward_context, "get_token_to_kv_pool", lambda: pool)
    assert mha_mla.attention_layers() == 4
    pool.layer_num = 1  # a one-layer model is a layer count too; a pool without layers is not
    assert mha_mla.attention_layers() == 1
    pool.layer_num = 0
    assert mha_mla.attention_layers() is None
    pool.layer_num = 4
    seen = []
    route = _router(SimpleNamespace(choose=lambda shape, layers=None: seen.append(layers) or "mla"))
    attn, fb = fake([512], [512])
    assert route(h._handle_attention_backend, attn, fb, "flashmla") == M.MLA and seen == [4]


def test_router_without_chunked_prefix_cache_still_chooses_for_fresh_prompts():
    """--disable-chunked-prefix-cache rules MHA out only where a cached prefix would need it: a batch without one is
    still the policy's; a batch that reports no prefix lengths at all is one with none (zeros, not ones)."""
    seen = []
    route = _router(SimpleNamespace(choose=lambda shape, layers=None: seen.append(shape) or "mha"))
    attn, fb = fake([512, 64], [0, 0], disable_chunked=True)
    assert route(h._handle_attention_backend, attn, fb, "flashmla") != M.MLA and seen[-1].prefix == [0, 0]
    attn, fb = fake([512], [512], disable_chunked=True)
    n = len(seen)
    assert route(h._handle_attention_backend, attn, fb, "flashmla") == M.MLA and len(seen) == n  # upstream's answer
    attn, fb = fake([256, 32], [0, 0])
    fb.extend_prefix_lens_cpu = None
    assert route(h._handle_attention_backend, attn, fb, "flashmla") != M.MLA and seen[-1].prefix == [0, 0]


def test_equivalent_uniform_of_a_batch_with_no_new_tokens():
    """se = 0 (nothing to extend): the uniform batch has extend 0 and the same mean prefix, with or without one."""
    assert mha_mla.equivalent_uniform(BatchShape([0, 0], [0, 0])) == (2, 0.0, 0.0)
    assert mha_mla.equivalent_uniform(BatchShape([0, 0], [100, 300])) == (2, 0.0, 200.0)
    assert mha_mla.equivalent_uniform(BatchShape([1], [0])) == (1, 1.0, 0.0)  # se = 1: one new token is not none
    b, e, p = mha_mla.equivalent_uniform(BatchShape([3, 5], [100, 300]))
    assert (b, p) == (2, 200.0) and b * e * e + 400 * e == pytest.approx(3 * 103 + 5 * 305)


def test_a_tie_goes_to_mha():
    """Equal modelled costs: MHA, upstream's choice for a prompt without a cached prefix."""
    same = CostTable("G", "measured on G", H200.mla, H200.mla)
    assert same.choose(BatchShape([512, 64], [0, 0])) == "mha"


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
    for target in (mha_mla.TARGET, mha_mla.BACKENDS_TARGET):
        assert compat.check_target(target) == (True, target)
    monkeypatch.setattr(compat, "gpu", lambda: compat.Gpu("NVIDIA H200", (9, 0), 140.0))
    for value, kind in (("se", CostTable), ("mha", Forced), ("mla", Forced)):
        hook, note = mha_mla.hooks(Settings.from_env({"SGLANG_H20_MHA_MLA_POLICY": value}))
        assert hook.target == mha_mla.TARGET and hook.kind == "around"
        assert isinstance(hook.fn.policy, kind)
        assert (note.target, note.kind, note.fn) == (mha_mla.BACKENDS_TARGET, "after", mha_mla.note_prefill_backend)


def test_a_prefill_backend_with_its_own_rule_is_named_once(caplog):
    """With --attention-backend triton (or trtllm_mla, aiter, ...) SGLang's DeepSeek prefill never reaches the hooked
    dispatch: the switch is on and nothing changes, so one line per process says so; shared-dispatch backends
    (flashmla, ours, ...) log nothing. Every name in SHARED_DISPATCH is registered with a handler that calls TARGET."""
    import inspect
    import logging
    import types

    from sglang.srt.models.deepseek_common import attention_backend_handler as h

    for name in mha_mla.SHARED_DISPATCH:
        if name != "h20_fp8_mla":  # ours registers at plugin load (fp8_mla_backend.dispatch_deepseek)
            assert "_handle_attention_backend(" in inspect.getsource(h.AttentionBackendRegistry.get_handler(name))
    assert "_handle_attention_backend(" not in inspect.getsource(h.AttentionBackendRegistry.get_handler("triton"))
    mha_mla._note.clear()
    with caplog.at_level(logging.INFO, logger="sglang_h20.mha_mla"):
        for name in ("flashmla", "h20_fp8_mla", None, "triton", "triton", "trtllm_mla"):
            assert mha_mla.note_prefill_backend(None, types.SimpleNamespace(prefill_attention_backend_str=name)) is None
    lines = [r.getMessage() for r in caplog.records if r.name == "sglang_h20.mha_mla"]
    assert len(lines) == 2 and "'triton'" in lines[0] and "'trtllm_mla'" in lines[1], lines
    assert all(ln.startswith("mha_mla policy: inert with prefill backend") for ln in lines)


def test_control_file_switches_the_policy_in_a_running_server(monkeypatch, tmp_path, caplog):
    """SGLANG_H20_MHA_MLA_CONTROL: one server alternates upstream's rule and ours (A/B inside one process)."""
    import os

    from sglang_h20.controlfile import write_control

    monkeypatch.setattr(compat, "gpu", lambda: compat.Gpu("NVIDIA H200", (9, 0), 140.0))
    ctl = tmp_path / "policy"
    hook, _ = mha_mla.hooks(Settings.from_env({"SGLANG_H20_MHA_MLA_POLICY": "se",
                                               "SGLANG_H20_MHA_MLA_CONTROL": str(ctl)}))
    policy = hook.fn.policy
    shape = BatchShape([1024], [1024])  # upstream: prefix < 8192 -> MLA; the H200 table: MHA (4x faster)
    assert UpstreamRule().choose(shape) == "mla" and mha_mla.load_table("NVIDIA H200").choose(shape) == "mha"
    assert policy.choose(shape) == "mha"  # no file yet: the switch's own value
    for i, (word, want) in enumerate((("upstream", "mla"), ("se", "mha"), ("mla", "mla"), ("bogus", "mla"))):
        write_control(ctl, word)
        os.utime(ctl, ns=(10**18 + i, 10**18 + i))  # a new version even within the clock's resolution
        assert policy.choose(shape) == want, word
    assert any("bogus" in r.getMessage() for r in caplog.records)


def test_a_retune_on_this_machine_takes_precedence_over_the_shipped_table(tmp_path, monkeypatch):
    """calibrate mha-mla writes ~/.cache/sglang_h20/mha_mla_<gpu>.json; the loader reads it first."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    user = mha_mla.user_table_path("NVIDIA H200")
    assert user == tmp_path / "sglang_h20" / "mha_mla_h200.json"
    shipped = mha_mla.load_table("NVIDIA H200")
    assert shipped.choose(BatchShape([1024], [1024])) == "mha"
    forced_mla = {**shipped.to_json(), "mha": {"const": 1e9}, "mla": {"const": 0.0}, "measured_grid": None,
                  "source": "measured on NVIDIA H200 (test)"}
    user.parent.mkdir(parents=True)
    user.write_text(json.dumps(forced_mla))
    assert mha_mla.load_table("NVIDIA H200").choose(BatchShape([1024], [1024])) == "mla"
    user.unlink()
    assert mha_mla.load_table("NVIDIA H200").choose(BatchShape([1024], [1024])) == "mha"


def test_measure_point_fills_the_prefix_cache_then_times_each_repeat(monkeypatch):
    """The server method's one point: with a prefix, one untimed call fills the radix cache; each repeat then times
    a batch of prefix + new words, and the point is the median of those wall times (a fake server and clock)."""
    from sglang_h20 import calibrate

    now, calls = [100.0], []
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: now[0])

    class Srv:  # each call takes the next of `took` seconds on the fake clock
        def generate_batch(self, texts, max_new_tokens):
            calls.append((len(texts), [len(t.split()) for t in texts], max_new_tokens))
            now[0] += next(took)

    took = iter([7.0, 0.5, 0.2, 0.9])  # the cache fill (7 s, not counted), then three repeats
    assert calibrate.measure_point(Srv(), 2, 3, 5, 3, random.Random(0)) == 0.5
    assert calls == [(2, [5, 5], 1)] + [(2, [8, 8], 1)] * 3
    calls.clear()
    took = iter([0.4])  # no prefix: nothing to fill, one timed repeat
    assert calibrate.measure_point(Srv(), 1, 4, 0, 1, random.Random(0)) == pytest.approx(0.4)
    assert calls == [(1, [4], 1)]


def test_calibrate_command_says_it_needs_a_gpu(monkeypatch, capsys):
    from sglang_h20 import calibrate

    monkeypatch.setattr(compat, "gpu", lambda: None)
    assert calibrate.main(["mha-mla"]) == 2
    assert calibrate.main(["mha-mla", "--method", "server"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


@pytest.mark.parametrize("grid", ["quick", "full"])
def test_calibrate_layer_method_writes_where_the_loader_looks_first(monkeypatch, tmp_path, capsys, grid):
    """The default re-tune (the layer method) measures the chosen grid and writes this machine's table, which
    load_table reads before the shipped one; --out overrides the place."""
    from sglang_h20 import calibrate
    from sglang_h20.attention import mha_mla_measure

    seen = []
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(compat, "gpu", lambda: compat.Gpu("NVIDIA H20", (9, 0), 96.0))
    monkeypatch.setattr(mha_mla_measure, "main", lambda argv: seen.append(argv) or 0)
    assert calibrate.main(["mha-mla", "--grid", grid, "--work-dir", str(tmp_path / "w")]) == 0
    argv = seen[-1]
    assert argv[argv.index("--write-table") + 1] == str(mha_mla.user_table_path("NVIDIA H20"))
    assert argv[argv.index("--json") + 1] == str(tmp_path / "w" / "mha_mla_layer.json")
    assert ("--quick" in argv) == (grid == "quick")
    assert calibrate.main(["mha-mla", "--grid", grid, "--out", str(tmp_path / "t.json")]) == 0
    assert seen[-1][seen[-1].index("--write-table") + 1] == str(tmp_path / "t.json")
    assert "the plugin now reads" in capsys.readouterr().out


def test_calibrate_model_command_writes_the_gpus_shipped_table_by_default(monkeypatch, tmp_path, capsys):
    """`calibrate mha-mla-model` needs no GPU; without --out it writes the package's table of that GPU (how the
    modelled H20 table is made), with --out there."""
    from sglang_h20 import calibrate

    monkeypatch.setattr(calibrate, "table_path", lambda gpu: tmp_path / f"shipped_{gpu.split()[-1]}.json")
    rates = ["--gpu", "NVIDIA H20", "--bf16-tflops", "148", "--hbm-tbs", "4.0"]
    assert calibrate.main(["mha-mla-model", *rates]) == 0
    written = json.loads((tmp_path / "shipped_H20.json").read_text())
    assert written["gpu"] == "NVIDIA H20" and "provenance" in written
    assert calibrate.main(["mha-mla-model", *rates, "--out", str(tmp_path / "mine.json")]) == 0
    assert json.loads((tmp_path / "mine.json").read_text())["gpu"] == "NVIDIA H20"


def test_calibrate_compares_both_paths_token_by_token():
    from sglang_h20 import calibrate

    a = [[[-0.5, 11], [-1.0, 12]], [[-0.25, 7]]]  # per prompt: [logprob, token] of each new token
    same = calibrate.compare_probes(a, [[[-0.75, 11], [-2.0, 12]], [[-0.25, 7]]])
    assert same["greedy_tokens_identical"] and same["max_abs_first_logprob_diff"] == 0.25
    assert same["first_logprobs"] == [[-0.5, -0.75], [-0.25, -0.25]]
    other = calibrate.compare_probes(a, [[[-0.5, 11], [-1.0, 13]], [[-0.25, 7]]])  # a later token differs
    assert not other["greedy_tokens_identical"] and other["max_abs_first_logprob_diff"] == 0.0


def test_grid_points_keep_every_point_up_to_the_token_bound():
    """Every (batch, extend, prefix) in grid order, but for points whose batch x (extend + prefix) tokens exceed
    MAX_POINT_TOKENS; a point exactly at the bound is measured."""
    half = MAX_POINT_TOKENS // 2
    grid = {"batch": [1, 2], "extend": [half, 1], "prefix": [0, 1]}
    assert grid_points(grid) == [(1, half, 0), (1, half, 1), (1, 1, 0), (1, 1, 1),
                                 (2, half, 0), (2, 1, 0), (2, 1, 1)]


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
    # one point measured against the grain: the method the other points' fit picks took 1.5x the other one there
    odd = dict(pts[len(pts) // 2])
    s = BatchShape([odd["extend"]] * odd["batch"], [odd["prefix"]] * odd["batch"])
    picked = H200.choose(s)
    other = "mla" if picked == "mha" else "mha"
    odd[f"{picked}_us"] = 1.5 * odd[f"{other}_us"]
    t = fit_table("NVIDIA H200", pts + [odd], {})
    assert t.meta["measured"] and t.source == "measured on NVIDIA H200"
    assert max(p["loss_vs_best_pct"] for p in pts) < 1.0
    assert odd["chosen"] == picked and odd["loss_vs_best_pct"] == pytest.approx(50.0)  # percent
    t8 = fit_table("NVIDIA H200", pts + [odd], {}, layers=8)  # per-layer coefficients from an 8-layer model
    for m in ("mha", "mla"):
        for term, v in getattr(t, m).items():
            assert getattr(t8, m)[term] == pytest.approx(v / 8, rel=1e-9, abs=1e-12)


# --- tables that carry their measured grid --------------------------------------------------------------------------

GRID_AXES = {"batch": [1, 4], "extend": [128, 1024, 8192], "prefix": [0, 4096, 65536]}


def bumped_points(skip=()):
    """Measured times that a linear model cannot follow: MLA has a 25% bump at extend 1024."""
    pts = []
    for b in GRID_AXES["batch"]:
        for e in GRID_AXES["extend"]:
            for p in GRID_AXES["prefix"]:
                if (b, e, p) in skip:
                    continue
                s = BatchShape([e] * b, [p] * b)
                pts.append({"batch": b, "extend": e, "prefix": p, "mha_us": H200.cost("mha", s),
                            "mla_us": H200.cost("mla", s) * (1.25 if e == 1024 else 1.0)})
    return pts


def grid_table(pts):
    return CostTable("NVIDIA H200", "measured on NVIDIA H200", H200.mha, H200.mla, {"measured": True},
                     mha_mla.grid_from_points(pts))


def test_grid_table_reproduces_its_measurements_and_round_trips():
    pts = bumped_points()
    t = grid_table(pts)
    for p in pts:
        s = BatchShape([p["extend"]] * p["batch"], [p["prefix"]] * p["batch"])
        assert t.cost("mha", s) == pytest.approx(p["mha_us"], rel=1e-9)
        assert t.cost("mla", s) == pytest.approx(p["mla_us"], rel=1e-9)
        assert t.choose(s) == ("mha" if p["mha_us"] <= p["mla_us"] else "mla")
    back = CostTable.from_json(json.loads(json.dumps(t.to_json())))
    assert back.measured_grid == t.measured_grid and "measured_grid" not in back.meta
    assert back.to_json()["measured_grid"]["mla_us"][0][1][0] == pts[3]["mla_us"]  # [batch 1][extend 1024][prefix 0]
    lin = CostTable.from_json({k: v for k, v in t.to_json().items() if k != "measured_grid"})
    s = BatchShape([1024], [0])
    assert lin.measured_grid is None and lin.cost("mla", s) < t.cost("mla", s)


def test_a_zero_time_in_the_grid_counts_as_unmeasured():
    """A node timed as 0 (no measurement) is filled from its neighbours like a missing one, not taken as a time."""
    grid = mha_mla.grid_from_points(bumped_points())
    zero, missing = json.loads(json.dumps(grid)), json.loads(json.dumps(grid))
    zero["mha_us"][0][1][0], missing["mha_us"][0][1][0] = 0.0, None  # [batch 1][extend 1024][prefix 0]
    tz, tm = (CostTable("NVIDIA H200", "measured on NVIDIA H200", H200.mha, H200.mla, {"measured": True}, g)
              for g in (zero, missing))
    s = BatchShape([1024], [0])
    assert tz.cost("mha", s) == tm.cost("mha", s) > 0


def test_grid_interpolates_between_nodes_and_keeps_the_linear_model_outside():
    t = grid_table(bumped_points())
    s = BatchShape([2048] * 2, [1024] * 2)  # between nodes on every axis: corrected by a fraction of the bump
    assert H200.cost("mla", s) < t.cost("mla", s) < 1.25 * H200.cost("mla", s)
    for s in (BatchShape([8192] * 2, [4096] * 2), BatchShape([32] * 64, [200000] * 64)):  # no bump / outside
        assert t.cost("mla", s) == pytest.approx(H200.cost("mla", s), rel=1e-9)
        assert t.cost("mha", s) == pytest.approx(H200.cost("mha", s), rel=1e-9)


def test_unmeasured_nodes_take_their_neighbours_residual():
    skipped = {(4, 1024, 4096): 3 / 4, (4, 128, 4096): 0.0, (4, 8192, 65536): 1 / 3}
    t = grid_table(bumped_points(skip=set(skipped)))
    # each unmeasured node: the mean log residual of its measured axis neighbours (MLA's 1.25 bump lies at extend
    # 1024). (4, 1024, 4096): batch 1, prefix 0 and 65536 bumped, extend 8192 not, extend 128 unmeasured;
    # (4, 128, 4096): prefix 0 and 65536 and batch 1, none bumped; (4, 8192, 65536): extend 1024 bumped of three
    for (b, e, p), bumped in skipped.items():
        s = BatchShape([e] * b, [p] * b)
        assert t.cost("mla", s) == pytest.approx(H200.cost("mla", s) * 1.25 ** bumped, rel=1e-9)
        assert t.cost("mha", s) == pytest.approx(H200.cost("mha", s), rel=1e-9)


def test_fill_on_a_grid_whose_axes_differ_in_length():
    """2 batches x 3 extends x 4 prefixes, distinct residuals: the residual keeps that shape, a measured node keeps its
    own, a hole with measured axis neighbours takes their mean, and a hole without any takes the nearest measured node
    of its own batch (at L1 distance 3) over a closer one of the other batch (distance 2)."""
    axes = {"batch": [1, 4], "extend": [128, 1024, 8192], "prefix": [0, 1024, 4096, 65536]}
    r = {(i, j, k): 0.01 * (100 * i + 10 * j + k + 1) for i in range(2) for j in range(3) for k in range(4)}
    holes = {(0, 2, 3), (0, 1, 3), (0, 2, 2), (0, 0, 3), (0, 1, 2), (0, 2, 1), (1, 2, 3)}
    grid = dict(axes)
    for m, coef in (("mha", H200.mha), ("mla", H200.mla)):
        grid[f"{m}_us"] = [[[None if (i, j, k) in holes else
                             mha_mla._linear(coef, mha_mla._uniform(b, e, p)) * math.exp(r[(i, j, k)])
                             for k, p in enumerate(axes["prefix"])] for j, e in enumerate(axes["extend"])]
                           for i, b in enumerate(axes["batch"])]
    g = mha_mla.MeasuredGrid.build(grid, H200.mha, H200.mla)
    for m in ("mha", "mla"):
        res = g.residual[m]
        assert [len(res), len(res[0]), len(res[0][0])] == [2, 3, 4] and all(len(c) == 4 for row in res for c in row)
        at = lambda n: res[n[0]][n[1]][n[2]]
        for n, want in r.items():
            if n not in holes:
                assert at(n) == pytest.approx(want, rel=1e-9), (m, n)
        mean = lambda *ns: sum(r[n] for n in ns) / len(ns)
        assert at((0, 1, 3)) == pytest.approx(mean((1, 1, 3)))  # (0, 0, 3), (0, 2, 3), (0, 1, 2) are holes
        assert at((0, 2, 2)) == pytest.approx(mean((1, 2, 2)))
        assert at((0, 1, 2)) == pytest.approx(mean((0, 0, 2), (0, 1, 1), (1, 1, 2)))
        assert at((1, 2, 3)) == pytest.approx(mean((1, 1, 3), (1, 2, 2)))
        assert at((0, 2, 3)) == pytest.approx(r[(0, 0, 2)])  # nearest in batch 0 (ties: the smaller index)
    # the nearest-node rule away from batch 0: a hole in batch 1 (no measured axis neighbour) takes its own batch's
    # nearest node (distance 3; ties: the smaller index) over the other batches' at one extend or prefix step (a
    # batch step weighs 100); nothing measured at all gives 0
    res = {(0, 3, 1): -1.0, (1, 0, 0): 2.0, (1, 3, 3): 3.0, (2, 2, 0): 4.0}
    assert mha_mla.MeasuredGrid._fill(res, 1, 3, 0) == 2.0
    assert mha_mla.MeasuredGrid._fill({}, 1, 3, 0) == 0.0


def test_mixed_batches_are_looked_up_at_the_uniform_batch_with_the_same_se_and_prefix():
    rng = random.Random(11)
    for _ in range(200):
        n = rng.randint(1, 16)
        s = BatchShape([rng.randint(1, 20000) for _ in range(n)],
                       [rng.choice([0, rng.randint(1, 70000)]) for _ in range(n)])
        b, e, p = mha_mla.equivalent_uniform(s)
        assert b == n and b * p == pytest.approx(sum(s.prefix))
        assert b * e * (e + p) == pytest.approx(s.se, rel=1e-9)
    assert mha_mla.equivalent_uniform(BatchShape([300] * 3, [700] * 3)) == pytest.approx((3, 300, 700))
    t = grid_table(bumped_points())
    for s in (BatchShape([8192, 16], [0, 65536]), BatchShape([512, 1536], [0, 0]),
              BatchShape([700, 1400, 900], [4096, 0, 2000])):
        b, e, p = mha_mla.equivalent_uniform(s)
        uniform = BatchShape([e] * b, [p] * b)  # the uniform batch the mixed one is looked up at
        for m in ("mha", "mla"):  # the grid's correction of the mixed batch is the uniform batch's
            assert t.cost(m, s) / t.linear_cost(m, s) == pytest.approx(t.cost(m, uniform) / t.linear_cost(m, uniform),
                                                                       rel=1e-9), (m, s)
        assert t.choose(s) == ("mha" if t.cost("mha", s) <= t.cost("mla", s) else "mla")
        # each lands near extend 1024 inside the grid, so MLA's 25% bump reaches it
        assert t.cost("mla", s) > 1.1 * H200.cost("mla", s) and t.cost("mha", s) == pytest.approx(H200.cost("mha", s))


def test_malformed_grids_are_rejected():
    g = mha_mla.grid_from_points(bumped_points())
    with pytest.raises(ValueError, match="mla_us must be nested lists of shape"):
        CostTable("G", "measured on G", H200.mha, H200.mla, {}, {**g, "mla_us": g["mla_us"][:1]})
    with pytest.raises(ValueError, match="axis extend must be ascending"):
        CostTable("G", "measured on G", H200.mha, H200.mla, {}, {**g, "extend": [1024, 128, 8192]})


def test_choice_is_cheap_and_remembered_for_the_next_layer():
    import time

    t = grid_table(bumped_points())
    rng = random.Random(0)  # 8 x at most 2000 new tokens: under MLA_MAX_EXTEND_TOKENS, so every one is modelled
    shapes = [BatchShape([rng.randint(1, 2000) for _ in range(8)], [i * 7] * 8) for i in range(400)]
    assert all(sum(s.extend) <= mha_mla.MLA_MAX_EXTEND_TOKENS for s in shapes)
    t0 = time.thread_time()  # CPU time of this thread: a descheduled or preempted test does not count
    first = [t.choose(s) for s in shapes]  # all new: computed
    per_call = (time.thread_time() - t0) / len(shapes)
    assert per_call < 1e-3  # pure Python on CPU lists; measured ~20 us
    assert len(t._memo) <= mha_mla.MEMO_SIZE
    fresh = grid_table(bumped_points())
    for s in shapes[: mha_mla.MEMO_SIZE + 1]:
        fresh.choose(s)
        assert len(fresh._memo) <= mha_mla.MEMO_SIZE
    assert [t.choose(s) for s in shapes] == first  # remembered or recomputed: the same answer
    # the next layer asks about the same batch: answered from memory, no cost computed again
    recent = shapes[-8:]
    answers = [t.choose(s) for s in recent]
    computed = []
    real = t.prefill_cost
    object.__setattr__(t, "prefill_cost", lambda *a, **k: computed.append(a) or real(*a, **k))
    assert [t.choose(s) for s in recent for _ in range(61)][::61] == answers and computed == []
    new = BatchShape([4242], [17])
    t.choose(new)
    assert len(computed) == 2  # a new batch: both methods costed once


def test_router_uses_a_grid_table_like_any_policy():
    original = h._handle_attention_backend
    route = _router(grid_table(bumped_points()))
    attn, fb = fake([16], [65536])  # upstream: MHA; 16 new tokens do not pay for expanding 64k
    assert original(attn, fb, "fa3") in (M.MHA_ONE_SHOT, M.MHA_CHUNKED_KV)
    assert route(original, attn, fb, "fa3") == M.MLA


def test_load_table_parses_each_version_of_a_file_once(tmp_path):
    """The start-up line and the router share one parse; a re-tune written over the file is read afresh."""
    path = tmp_path / "t.json"
    shipped = mha_mla.table_path("NVIDIA H200")
    path.write_text(shipped.read_text())
    first = mha_mla.load_table("NVIDIA H200", path)
    assert mha_mla.load_table("NVIDIA H200", path) is first
    data = json.loads(shipped.read_text())
    data["gpu"] = "NVIDIA H20 retuned"
    path.write_text(json.dumps(data))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    again = mha_mla.load_table("NVIDIA H200", path)
    assert again is not first and again.gpu == "NVIDIA H20 retuned"
