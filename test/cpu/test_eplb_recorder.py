"""Co-activation recorder (torch, CPU here) and its SGLang 0.5.17 integration.

Counts are checked against a brute-force Python count. The rebalance wrapper is checked against
the real installed `sglang.srt.eplb.eplb_algorithms` (deepseek algorithm) for the same inputs.
"""
import importlib
import inspect
import json
import logging
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sglang_h20 import compat
from sglang_h20.eplb import integration, placement
from sglang_h20.eplb import recorder as recorder_mod
from sglang_h20.eplb.recorder import CoactivationRecorder
from sglang_h20.eplb.stats import CoactivationStats
from sglang_h20.settings import Settings

import sglang.srt.eplb.eplb_algorithms as eplb_algorithms  # noqa: E402  (sglang 0.5.17 is pinned: a move fails)
EplbAlgorithm = eplb_algorithms.EplbAlgorithm
UPSTREAM_REBALANCE = inspect.unwrap(eplb_algorithms.rebalance_experts)
UPSTREAM_COMPUTE = inspect.unwrap(eplb_algorithms.compute_algorithm)
ON = Settings.from_env({"SGLANG_H20_EPLB": "affinity"})


# ----------------------------------------------------------------------------- helpers
def brute_force(layers, num_layers, num_experts, num_valid=None):
    """layers: list of (layer_id, ids [T, K] list of lists). Python loops over tokens and pairs."""
    coact = np.zeros((num_layers, num_experts, num_experts), dtype=np.int64)
    tokens = np.zeros(num_layers, dtype=np.int64)
    for layer, ids in layers:
        for t, row in enumerate(ids):
            if num_valid is not None and t >= num_valid:
                continue
            picked = sorted({int(x) for x in row if 0 <= int(x) < num_experts})
            if picked:
                tokens[layer] += 1
            for i in picked:
                for j in picked:
                    coact[layer, i, j] += 1
    return coact, int(tokens.max()) if num_layers else 0


def random_routing(rng, T, K, E, pad_rows=0, shared_col=False):
    """Top-k ids with duplicates inside tokens, -1 entries, -1 padded rows, optional ids >= E."""
    ids = rng.integers(0, E, size=(T, K))
    ids[rng.random((T, K)) < 0.15] = -1
    dup = rng.random(T) < 0.3
    ids[dup, 1] = ids[dup, 0]  # duplicate within a token
    if pad_rows:
        ids[T - pad_rows:] = -1
    if shared_col:  # fused shared-expert slots sit at ids >= E
        ids = np.concatenate([ids, np.full((T, 1), E), rng.integers(E, 3 * E, size=(T, 1))], axis=1)
    return ids


@pytest.fixture(autouse=True)
def fresh_integration_state():
    integration.reset_state()
    yield
    integration.reset_state()


@pytest.fixture
def eplb_log():
    records = []

    class ListHandler(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    h = ListHandler()
    integration.log.addHandler(h)
    old = integration.log.level
    integration.log.setLevel(logging.INFO)
    yield records
    integration.log.removeHandler(h)
    integration.log.setLevel(old)


# ----------------------------------------------------------------------------- recorder
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_counts_equal_brute_force(seed):
    rng = np.random.default_rng(seed)
    L, E, K = 3, 12, 4
    rec = CoactivationRecorder(L, E, "cpu")
    calls = []
    for _ in range(5):
        layer = int(rng.integers(0, L))
        ids = random_routing(rng, int(rng.integers(1, 40)), K, E, pad_rows=int(rng.integers(0, 3)),
                             shared_col=bool(rng.integers(0, 2)))
        calls.append((layer, ids.tolist()))
        rec.record(layer, torch.tensor(ids, dtype=torch.int32))
    want, want_tokens = brute_force(calls, L, E)
    snap = rec.snapshot()
    assert snap.coact.dtype == np.int64 and snap.coact.shape == (L, E, E)
    np.testing.assert_array_equal(snap.coact, want)
    assert snap.tokens == want_tokens
    assert want.sum() > 0  # the check compared something


def test_snapshot_symmetric_and_diagonal_is_load():
    rng = np.random.default_rng(7)
    L, E, K, T = 2, 16, 6, 200
    rec = CoactivationRecorder(L, E, "cpu")
    ids = random_routing(rng, T, K, E)
    for layer in range(L):
        rec.record(layer, torch.tensor(ids))
    s = rec.snapshot()
    np.testing.assert_array_equal(s.coact, s.coact.transpose(0, 2, 1))
    load = np.zeros((L, E), dtype=np.int64)
    for row in ids:
        for e in {int(x) for x in row if x >= 0}:
            load[:, e] += 1
    np.testing.assert_array_equal(s.load, load)
    # the numpy reference in stats.py agrees on the counts
    ref = CoactivationStats.from_topk_ids(np.stack([ids] * L), E)
    np.testing.assert_array_equal(s.coact, ref.coact)


def test_num_valid_tokens_masks_padded_rows_int_and_tensor():
    rng = np.random.default_rng(3)
    L, E, K, T, n = 1, 10, 3, 30, 17
    ids = rng.integers(0, E, size=(T, K))  # padded rows hold garbage ids, as before SGLang masks them
    want, want_tokens = brute_force([(0, ids.tolist())], L, E, num_valid=n)
    for limit in (n, torch.tensor(n), torch.tensor([n])):
        rec = CoactivationRecorder(L, E, "cpu")
        rec.record(0, torch.tensor(ids), limit)
        np.testing.assert_array_equal(rec.snapshot().coact, want)
        assert rec.snapshot().tokens == want_tokens == n


def test_chunked_rows_match_brute_force(monkeypatch):
    monkeypatch.setattr(recorder_mod, "MAX_ROWS_PER_GEMM", 7)
    rng = np.random.default_rng(11)
    L, E, K, T, n = 2, 9, 3, 50, 41
    ids = random_routing(rng, T, K, E)
    rec = CoactivationRecorder(L, E, "cpu")
    rec.record(1, torch.tensor(ids), torch.tensor(n))
    want, want_tokens = brute_force([(1, ids.tolist())], L, E, num_valid=n)
    np.testing.assert_array_equal(rec.snapshot().coact, want)
    assert rec.snapshot().tokens == want_tokens


def test_sampling_records_every_nth_step_only():
    rng = np.random.default_rng(5)
    L, E, K, n = 1, 8, 3, 3
    rec = CoactivationRecorder(L, E, "cpu", sample_every=n)
    sampled = []
    for step in range(10):
        ids = random_routing(rng, 20, K, E)
        if step % n == 0:
            sampled.append((0, ids.tolist()))
        assert rec.sampling == (step % n == 0)
        rec.record(0, torch.tensor(ids))
        rec.step()
    want, _ = brute_force(sampled, L, E)
    np.testing.assert_array_equal(rec.snapshot().coact, want)
    assert len(sampled) == 4


def test_an_unsampled_eager_step_launches_nothing(monkeypatch):
    """Eager (no graph being captured), an unsampled or inactive step returns before any op: the gate would zero
    its counts anyway, so the work would be spent for nothing on every layer of every decode step."""
    rec = CoactivationRecorder(1, 8, "cpu", sample_every=2)
    calls = []
    monkeypatch.setattr(rec, "_accumulate", lambda *a: calls.append(a[0]))
    ids = torch.tensor([[0, 1], [2, 3]])
    rec.record(0, ids)  # step 0: sampled
    rec.step()
    rec.record(0, ids)  # step 1: not sampled
    rec.step()
    rec.set_active(False)
    rec.record(0, ids)  # step 2 would be sampled, but recording is off
    assert calls == [0]


def test_graph_path_gates_on_device(monkeypatch):
    """While a graph is captured the ops always run; the device gate zeroes unsampled steps."""
    monkeypatch.setattr(recorder_mod, "_capturing", lambda device: True)
    rng = np.random.default_rng(9)
    L, E, K = 1, 8, 4
    rec = CoactivationRecorder(L, E, "cpu", sample_every=2)
    sampled = []
    for step in range(6):
        ids = random_routing(rng, 15, K, E)
        if step % 2 == 0:
            sampled.append((0, ids.tolist()))
        rec.record(0, torch.tensor(ids))
        assert float(rec._gate) == (1.0 if step % 2 == 0 else 0.0)
        rec.step()
    rec.set_active(False)
    rec.record(0, torch.tensor(random_routing(rng, 15, K, E)))  # inactive: gated to zero
    want, want_tokens = brute_force(sampled, L, E)
    np.testing.assert_array_equal(rec.snapshot().coact, want)
    assert rec.snapshot().tokens == want_tokens


def test_inactive_records_nothing_and_reset_zeroes():
    rec = CoactivationRecorder(2, 4, "cpu")
    rec.set_active(False)
    rec.record(0, torch.tensor([[0, 1], [2, 3]]))
    assert rec.snapshot().coact.sum() == 0
    rec.set_active(True)
    rec.record(0, torch.tensor([[0, 1], [2, 3]]))
    assert rec.snapshot().coact.sum() == 8 and rec.snapshot().tokens == 2
    rec.reset()
    assert rec.snapshot().coact.sum() == 0 and rec.snapshot().tokens == 0


def test_bad_arguments_raise():
    rec = CoactivationRecorder(2, 4, "cpu")
    with pytest.raises(IndexError):
        rec.record(2, torch.tensor([[0, 1]]))
    with pytest.raises(ValueError):
        rec.record(0, torch.tensor([0, 1]))
    with pytest.raises(ValueError):
        CoactivationRecorder(2, 4, "cpu", sample_every=0)
    for layers, experts in ((0, 4), (2, 0), (-1, 4)):  # no layers or no experts: nothing to record into
        with pytest.raises(ValueError, match="num_layers, num_experts > 0"):
            CoactivationRecorder(layers, experts, "cpu")


def test_dump_load_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    rec = CoactivationRecorder(3, 6, "cpu")
    for layer in range(3):
        rec.record(layer, torch.tensor(random_routing(rng, 25, 3, 6)))
    path = rec.dump(tmp_path / "coact.npz")
    back = CoactivationStats.load_file(path)
    snap = rec.snapshot()
    np.testing.assert_array_equal(back.coact, snap.coact)
    assert back.tokens == snap.tokens > 0


# ----------------------------------------------------------------------------- hooks
def test_every_hook_target_resolves_against_installed_sglang():
    hooks = integration.hooks(ON)
    assert len(hooks) == 7
    for hook in hooks:
        assert compat.check_target(hook.target) == (True, hook.target)
        assert hook.kind in ("before", "after", "around", "replace")
    assert integration.hooks(Settings.from_env({"SGLANG_H20_EPLB": "off"})) == []


@pytest.mark.parametrize("module", ["integration", "async_rebalance"])
def test_a_server_without_sglangs_eplb_is_told_once(module, caplog):
    """SGLANG_H20_EPLB=affinity or SGLANG_H20_EPLB_ASYNC=on without --enable-eplb: SGLang makes no EPLB manager, no
    rebalance ever runs, and the switch would change nothing without a word. One line per process; none with a
    manager, none from a draft runner (which never has one)."""
    import logging
    import types

    from sglang_h20.eplb import async_rebalance

    mod = {"integration": integration, "async_rebalance": async_rebalance}[module]
    env = {"SGLANG_H20_EPLB": "affinity"} if module == "integration" else {"SGLANG_H20_EPLB_ASYNC": "on"}
    (hook,) = [h for h in mod.hooks(Settings.from_env(env)) if h.target == integration.RUNNER_INIT_TARGET]
    assert hook.kind == "after"
    mod._note.clear()
    runner = lambda manager, draft=False: types.SimpleNamespace(eplb_manager=manager, is_draft_worker=draft)
    with caplog.at_level(logging.INFO, logger="sglang_h20.eplb"):
        for r in (runner(object()), runner(None, draft=True)):  # each alone, the once-only guard cleared
            mod._note.clear()
            assert hook.fn(None, r) is None
        assert not caplog.records
        for r in (runner(None), runner(None)):
            assert hook.fn(None, r) is None
    lines = [r.getMessage() for r in caplog.records]
    prefix = "eplb: " if module == "integration" else "eplb_async: "
    assert lines == [prefix + "SGLang's EPLB is off in this server (no --enable-eplb), so "
                     + ("no affinity placement is made (co-activation is still recorded whenever SGLang's "
                        "expert-distribution recorder records)" if module == "integration"
                        else "there is no rebalance to run without stalling decode")], lines


def test_post_process_parameter_order_matches_sglang():
    topk = importlib.import_module(integration.TOPK_MODULE)  # a moved module fails here, as it should
    fn = inspect.unwrap(topk._post_process_topk_ids)
    assert tuple(inspect.signature(fn).parameters) == integration.POST_PROCESS_PARAMS


def test_hook_functions_follow_sglang_recorder_window(monkeypatch, tmp_path):
    """Record hook + window hook + step hook + dump hook, called the way SGLang calls them."""
    L, E = 4, 8
    monkeypatch.setattr(integration, "_metadata_shape", lambda: (L, E))
    monkeypatch.setenv("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR", str(tmp_path))
    target_cfg = SimpleNamespace(allow_routed_experts_capture=True)
    draft_cfg = SimpleNamespace(allow_routed_experts_capture=False)
    meta = SimpleNamespace(num_layers=L, num_logical_experts=E, physical_to_logical_map=torch.zeros(L, E))
    sglang_rec = SimpleNamespace(recording=True, _expert_location_metadata=meta)
    ids = torch.tensor([[0, 1, 8], [2, 2, -1], [5, 6, 7], [3, 4, 0]], dtype=torch.int32)

    def select_experts(layer_id, cfg, n=None):  # keyword call, as in sglang's select_experts
        integration.on_post_process_topk_ids(
            topk_ids=ids, topk_weights=torch.ones(ids.shape), topk_config=cfg, router_logits=None,
            num_token_non_padded=n, layer_id=layer_id, expert_location_dispatch_info=None)

    select_experts(1, target_cfg)  # warm-up: before any real forward pass, not counted
    rec = integration.get_recorder()
    assert rec is not None and rec.snapshot().coact.sum() == 0
    integration.on_forward_pass(sglang_rec, 0, None)
    select_experts(1, target_cfg, torch.tensor(3))  # the 4th row is padding
    select_experts(2, draft_cfg)  # MTP/draft layer: skipped
    select_experts(L + 3, target_cfg)  # out-of-range layers: skipped quietly, the recorder stays on
    select_experts(L, target_cfg)
    assert integration._state.disabled is None
    integration.on_forward_pass_end(None)
    assert rec.step_count == 1
    want, want_tokens = brute_force([(1, ids.tolist())], L, E, num_valid=3)
    np.testing.assert_array_equal(rec.snapshot().coact, want)

    assert integration.after_dump_record(None, sglang_rec, output_mode="object") is None
    snap = integration.latest_snapshot()
    np.testing.assert_array_equal(snap.coact, want)
    assert snap.tokens == want_tokens == 3
    assert rec.snapshot().coact.sum() == 0  # reset after the dump, as SGLang does

    integration.on_forward_pass(sglang_rec, 1, None)
    select_experts(3, target_cfg)  # counted, then dropped: start_record below opens a new window
    assert rec.snapshot().coact.sum() > 0
    sglang_rec.recording = False  # stop_record: not recorded
    integration.on_forward_pass(sglang_rec, 2, None)
    select_experts(1, target_cfg)
    assert rec.snapshot().coact[1].sum() == 0
    sglang_rec.recording = True  # start_record again: a new window
    integration.on_forward_pass(sglang_rec, 3, None)
    select_experts(0, target_cfg)
    integration.after_dump_record(None, sglang_rec)  # file mode: rank 0 writes next to SGLang's dump
    files = list(tmp_path.glob("coactivation_*.npz"))
    assert len(files) == 1
    want0, _ = brute_force([(0, ids.tolist())], L, E)
    np.testing.assert_array_equal(CoactivationStats.load_file(files[0]).coact, want0)


def test_recorder_built_inside_inference_mode_updates_outside(monkeypatch):
    """SGLang runs the forward (and so our lazy allocation) under torch.inference_mode, while
    step() and the dump's reset() run outside it."""
    monkeypatch.setattr(integration, "_metadata_shape", lambda: (2, 4))
    monkeypatch.setattr(integration, "SAMPLE_EVERY", 2)
    integration.on_forward_pass(SimpleNamespace(recording=True), 0, None)
    with torch.inference_mode():
        integration.on_post_process_topk_ids(torch.tensor([[0, 1]]), None, None, None, 1)
    integration.on_forward_pass_end(None)  # gate fill_ outside inference mode
    meta = SimpleNamespace(num_layers=2, num_logical_experts=4, physical_to_logical_map=torch.zeros(1))
    integration.after_dump_record(None, SimpleNamespace(_expert_location_metadata=meta), "object")
    assert integration._state.disabled is None
    assert integration.latest_snapshot().coact[1].sum() == 4 and integration.get_recorder().acc.sum() == 0


def test_recorder_line_states_its_size(monkeypatch, eplb_log):
    """The recorder's one line gives the accumulator's real size: DeepSeek-V3's 61 layers x 257^2 int64 counts are
    31 MiB of GPU memory, the figure an operator weighs against the KV pool."""
    monkeypatch.setattr(integration, "_metadata_shape", lambda: (61, 256))
    integration.on_forward_pass(SimpleNamespace(recording=True), 0, None)
    integration.on_post_process_topk_ids(torch.tensor([[0, 1]]), None, None, None, 1)  # allocates lazily
    assert integration.get_recorder().acc.nbytes == 61 * 257 * 257 * 8
    assert [line for line in eplb_log if "co-activation recorder:" in line] == [
        f"co-activation recorder: 61 layers x 256 experts on cpu (31 MiB), sample every {integration.SAMPLE_EVERY} "
        "step(s)"]


def test_record_hook_never_raises(monkeypatch):
    monkeypatch.setattr(integration, "_metadata_shape", lambda: (2, 4))
    integration.on_forward_pass(SimpleNamespace(recording=True), 0, None)
    bad = torch.zeros(3)  # 1-D: the recorder rejects it
    assert integration.on_post_process_topk_ids(bad, None, None, None, 0) is None
    assert integration._state.disabled is not None


def test_compute_algorithm_accepts_affinity():
    call = lambda raw: integration.around_compute_algorithm(UPSTREAM_COMPUTE, raw_algorithm=raw,
                                                            num_groups=8, num_nodes=2)
    assert call("affinity") is integration.AFFINITY_ALGORITHM
    assert call("deepseek") is EplbAlgorithm.deepseek
    assert call("auto") is EplbAlgorithm.deepseek_hierarchical
    # upstream's callers may pass the name positionally
    assert integration.around_compute_algorithm(UPSTREAM_COMPUTE, "affinity", 8, 2) is integration.AFFINITY_ALGORITHM
    assert integration.around_compute_algorithm(UPSTREAM_COMPUTE, "deepseek", 8, 2) is EplbAlgorithm.deepseek


def test_a_failing_hook_turns_recording_off_with_one_warning_per_place(caplog):
    """An error in a pass hook never reaches serving: the recorder is off, named by the hook and the error, and
    each hook warns once however often it fails."""
    def boom():
        raise RuntimeError("boom")

    integration._state.recorder = SimpleNamespace(step=boom, set_active=lambda want: boom())
    with caplog.at_level(logging.WARNING, logger="sglang_h20.eplb"):
        for _ in range(3):
            assert integration.on_forward_pass_end() is None
        assert integration._state.disabled == "on_forward_pass_end: RuntimeError: boom"
        assert integration.on_forward_pass(SimpleNamespace(recording=False)) is None
        assert integration._state.disabled == "with_forward_pass: RuntimeError: boom"
    assert [r.getMessage() for r in caplog.records] == [
        "co-activation recorder off after an error in on_forward_pass_end: RuntimeError: boom",
        "co-activation recorder off after an error in with_forward_pass: RuntimeError: boom"]


# ----------------------------------------------------------------------------- rebalance
L_, E_, P_, LOCAL_, GROUPS_, NODES_ = 5, 16, 24, 6, 4, 2  # 4 GPUs on 2 nodes, 6 slots each


def rebalance_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens_per_expert = torch.randint(0, 1000, (3, L_, E_), generator=g)
    return dict(tokens_per_expert=tokens_per_expert, num_physical_experts=P_,
                num_local_physical_experts=LOCAL_, num_groups=GROUPS_, num_nodes=NODES_)


def recorded_stats(seed=0):
    rng = np.random.default_rng(seed)
    rec = CoactivationRecorder(L_, E_, "cpu")
    for layer in range(L_):
        rec.record(layer, torch.tensor(random_routing(rng, 300, 4, E_)))
    return rec.snapshot()


def check_sglang_contract(result, upstream):
    """Same tuple layout, dtypes, ranks and [L, P] / [L, E] shapes as the deepseek algorithm."""
    phy2log, log2phy, logcnt = result
    u_phy2log, u_log2phy, u_logcnt = upstream
    for ours, theirs in zip(result, upstream):
        assert isinstance(ours, torch.Tensor) and ours.dtype == theirs.dtype == torch.int64
        assert ours.dim() == theirs.dim() and ours.device == theirs.device
    assert phy2log.shape == u_phy2log.shape == (L_, P_)
    assert logcnt.shape == u_logcnt.shape == (L_, E_)
    assert log2phy.shape[:2] == u_log2phy.shape[:2] == (L_, E_)
    assert log2phy.shape[2] == int(logcnt.max())  # padded to the largest replica count, like upstream
    # a valid placement: every logical expert has >= 1 replica, and the three maps agree
    assert (logcnt >= 1).all() and int(logcnt.sum()) == L_ * P_
    for layer in range(L_):
        for e in range(E_):
            slots = log2phy[layer, e]
            n = int(logcnt[layer, e])
            assert (slots[n:] == -1).all() and (slots[:n] >= 0).all()
            assert (phy2log[layer, slots[:n]] == e).all()
            assert sorted(slots[:n].tolist()) == (phy2log[layer] == e).nonzero().flatten().tolist()


@pytest.mark.parametrize("algorithm", [EplbAlgorithm.deepseek, EplbAlgorithm.deepseek_hierarchical])
def test_sglang_maps_reproduce_deepseek_output(algorithm):
    inputs = rebalance_inputs(1)
    phy2log, log2phy, logcnt = UPSTREAM_REBALANCE(**inputs, algorithm=algorithm)
    ours = integration.sglang_maps(phy2log.numpy(), E_)
    torch.testing.assert_close(ours[0], phy2log)
    torch.testing.assert_close(ours[2], logcnt)
    assert ours[1].shape == log2phy.shape
    torch.testing.assert_close(ours[1].sort(dim=-1).values, log2phy.sort(dim=-1).values)


def test_sglang_maps_rejects_missing_expert():
    p2l = np.zeros((1, 4), dtype=np.int64)
    p2l[0] = [0, 1, 1, 3]
    with pytest.raises(ValueError, match="expert 2 has no replica"):
        integration.sglang_maps(p2l, 4)
    # an id out of range on either side alone: refused by name (not an index error from the scatter)
    for bad in ([0, 1, 2, 4], [-1, 1, 2, 3]):
        with pytest.raises(ValueError, match=re.escape("phy2log holds ids outside [0, 4)")):
            integration.sglang_maps(np.array([bad]), 4)


@pytest.mark.parametrize("algorithm", [EplbAlgorithm.deepseek_hierarchical, integration.AFFINITY_ALGORITHM])
def test_no_snapshot_falls_back_to_upstream(algorithm, eplb_log):
    wrapper = integration.make_rebalance_wrapper(ON)
    inputs = rebalance_inputs(2)
    got = wrapper(UPSTREAM_REBALANCE, **inputs, algorithm=algorithm)
    want = UPSTREAM_REBALANCE(**inputs, algorithm=EplbAlgorithm.deepseek_hierarchical)  # = "auto" here
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert len(eplb_log) == 1 and "no co-activation snapshot yet" in eplb_log[0]


@pytest.mark.parametrize("snapshot, reason", [
    (lambda: CoactivationStats(np.ones((L_, E_ + 1, E_ + 1), np.int64), 5), "SGLang asks for 5 x 16"),  # wrong shape
    (lambda: CoactivationStats(recorded_stats(8).coact, 0), "holds no tokens"),  # empty
])
def test_snapshot_it_cannot_use_falls_back(snapshot, reason, eplb_log):
    integration.set_latest_snapshot(snapshot())
    inputs = rebalance_inputs(3)
    got = integration.make_rebalance_wrapper(ON)(UPSTREAM_REBALANCE, **inputs, algorithm=EplbAlgorithm.deepseek)
    want = UPSTREAM_REBALANCE(**inputs, algorithm=EplbAlgorithm.deepseek)
    torch.testing.assert_close(got[0], want[0])
    assert len(eplb_log) == 1 and reason in eplb_log[0]


@pytest.mark.parametrize("stats_tokens, layout, reason", [
    (0, {}, "the co-activation snapshot holds no tokens"),
    (5, {"num_local_physical_experts": 0}, "24 slots, 0 per GPU, 2 node(s) is no N x G x S layout"),
    (5, {"num_local_physical_experts": 5}, "24 slots, 5 per GPU, 2 node(s) is no N x G x S layout"),
    (5, {"num_local_physical_experts": 8}, "24 slots, 8 per GPU, 2 node(s) is no N x G x S layout"),  # 3 GPUs
])
def test_snapshot_or_layout_it_cannot_place_is_a_fallback(stats_tokens, layout, reason):
    """Each reason alone makes the affinity placement give way to upstream's algorithm: an empty snapshot, no slots
    per GPU, slots that do not divide into GPUs, GPUs that do not divide into the nodes."""
    stats = recorded_stats(7)
    with pytest.raises(integration._Fallback, match=re.escape(reason)):
        integration._affinity_rebalance(CoactivationStats(stats.coact, stats_tokens),
                                        {**rebalance_inputs(7), **layout}, 0.5)


def test_one_slot_per_gpu_is_a_layout_it_places():
    """One slot per GPU (256 experts on 256 GPUs; here 16 on 16) is a valid N x G x S layout (S = 1), placed, each
    layer's slots a permutation of its experts, with the upstream-shaped maps."""
    stats = recorded_stats(8)
    inputs = {**rebalance_inputs(8), "num_physical_experts": E_, "num_local_physical_experts": 1}
    phy2log, log2phy, logcnt = integration._affinity_rebalance(stats, inputs, 0.5)
    assert phy2log.shape == (L_, E_) and (logcnt == 1).all()
    for layer in range(L_):
        assert sorted(phy2log[layer].tolist()) == list(range(E_))
        assert (phy2log[layer][log2phy[layer, :, 0]] == torch.arange(E_)).all()


def test_switch_off_and_no_affinity_algorithm_is_untouched():
    off = Settings.from_env({"SGLANG_H20_EPLB": "off"})
    integration.set_latest_snapshot(recorded_stats())
    inputs = rebalance_inputs(4)
    got = integration.make_rebalance_wrapper(off)(UPSTREAM_REBALANCE, **inputs, algorithm=EplbAlgorithm.deepseek)
    want = UPSTREAM_REBALANCE(**inputs, algorithm=EplbAlgorithm.deepseek)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_wrapper_contract_with_a_stub_place(monkeypatch, eplb_log):
    """The wiring (topology, snapshot, conversion) independent of the real placement algorithm."""
    seen = {}

    def stub_place(stats, topo, algorithm, *, affinity=0.5, seed=0):
        seen.update(stats=stats, topo=topo, algorithm=algorithm)
        rng = np.random.default_rng(seed)
        phy2log = np.stack([rng.permutation(np.arange(topo.num_slots) % stats.num_experts)
                            for _ in range(stats.num_layers)])
        return placement.Placement(phy2log, topo, stats.num_experts, algorithm)

    monkeypatch.setattr(placement, "place", stub_place)
    stats = recorded_stats(5)
    integration.set_latest_snapshot(stats)
    inputs = rebalance_inputs(5)
    got = integration.make_rebalance_wrapper(ON)(UPSTREAM_REBALANCE, **inputs, algorithm=EplbAlgorithm.deepseek)
    check_sglang_contract(got, UPSTREAM_REBALANCE(**inputs, algorithm=EplbAlgorithm.deepseek))
    assert seen["stats"] is stats and seen["algorithm"] == "affinity"
    assert seen["topo"] == placement.Topology(num_nodes=2, gpus_per_node=2, slots_per_gpu=6)
    assert "placed 5 layers x 24 slots" in eplb_log[-1]


def test_wrapper_with_real_place(eplb_log):
    place = placement.place
    stats = recorded_stats(6)
    stats.coact[0] = 0  # a dense layer (DeepSeek-V3 layers 0-2): never routed, still placed
    integration.set_latest_snapshot(stats)
    for algorithm in (EplbAlgorithm.deepseek, integration.AFFINITY_ALGORITHM):
        eplb_log.clear()
        inputs = rebalance_inputs(6)
        got = integration.make_rebalance_wrapper(ON)(UPSTREAM_REBALANCE, **inputs, algorithm=algorithm)
        assert eplb_log == ["eplb affinity: placed 5 layers x 24 slots from 300 recorded tokens"]  # no fallback
        check_sglang_contract(got, UPSTREAM_REBALANCE(**inputs, algorithm=EplbAlgorithm.deepseek))
        topo = placement.Topology(NODES_, P_ // LOCAL_ // NODES_, LOCAL_)
        placement.Placement(got[0].numpy(), topo, E_).validate()
        want = place(stats, topo, "affinity").phy2log  # deterministic (seed 0): exactly place's answer
        np.testing.assert_array_equal(got[0].numpy(), want)


# ----------------------------------------------------------------------------- through HookRegistry
E2E = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
from types import SimpleNamespace
import numpy as np, torch
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang_h20.eplb import integration
from sglang_h20.eplb.stats import CoactivationStats
from sglang_h20.settings import Settings

for h in integration.hooks(Settings.from_env({"SGLANG_H20_EPLB": "affinity"})):
    HookRegistry.register(h.target, h.fn, HookType(h.kind))
HookRegistry.apply_hooks()
from sglang.srt.eplb import eplb_algorithms
from sglang.srt.eplb.eplb_manager import EPLBManager
from sglang.srt.eplb.expert_distribution import _ExpertDistributionRecorderReal as Real
from sglang.srt.layers.moe import topk as topk_mod

L, E = 4, 16
integration._metadata_shape = lambda: (L, E)
meta = SimpleNamespace(num_layers=L, num_logical_experts=E, physical_to_logical_map=torch.zeros(1))
fake = SimpleNamespace(recording=True, _expert_location_metadata=meta, _main_generator=iter(range(9)),
                       _accumulator=SimpleNamespace(dump=lambda output_mode: {"logical_count": None}),
                       _reset=lambda: None)
Real.with_forward_pass(fake, 0, None)  # our BEFORE hook runs; the context manager is not entered
cfg = topk_mod.TopKConfig(top_k=4, renormalize=True)
cfg.torch_native = True
torch.manual_seed(0)
ids = []
for layer in (1, 2, 3):
    out = topk_mod.select_experts(hidden_states=torch.randn(50, 8), router_logits=torch.randn(50, E),
                                  topk_config=cfg, layer_id=layer)
    ids.append((layer, out.topk_ids.tolist()))
EPLBManager.on_forward_pass_end(fake)
dumped = Real.dump_record(fake, output_mode="object")
snap = integration.latest_snapshot()
alg = eplb_algorithms.compute_algorithm(raw_algorithm="affinity", num_groups=4, num_nodes=2)
res = eplb_algorithms.rebalance_experts(tokens_per_expert=torch.ones(2, L, E), num_physical_experts=24,
                                        num_local_physical_experts=6, num_groups=4, num_nodes=2, algorithm=alg)
json.dump(dict(ids=ids, coact=snap.coact.tolist(), tokens=snap.tokens, dumped=dumped,
               step=integration.get_recorder().step_count, alg=repr(alg),
               shapes=[list(t.shape) for t in res], dtypes=[str(t.dtype) for t in res],
               logcnt_min=int(res[2].min()), logcnt_max=int(res[2].max())), sys.stdout)
"""


def test_hooks_through_hook_registry_and_real_select_experts(tmp_path):
    """Fresh process: register + apply our hooks with SGLang's HookRegistry, then drive the patched
    SGLang functions (real select_experts on CPU, compute_algorithm, rebalance_experts)."""
    script = tmp_path / "e2e.py"
    script.write_text(E2E)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_H20_") and k != "SGLANG_PLUGINS"}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    want, want_tokens = brute_force(got["ids"], 4, 16)
    assert want.sum() > 0
    np.testing.assert_array_equal(np.array(got["coact"]), want)
    assert got["tokens"] == want_tokens == 50 and got["step"] == 1
    assert got["dumped"] == {"logical_count": None}  # SGLang's own result passes through
    assert got["alg"] == repr(integration.AFFINITY_ALGORITHM)
    assert got["shapes"] == [[4, 24], [4, 16, got["logcnt_max"]], [4, 16]]
    assert got["dtypes"] == ["torch.int64"] * 3 and got["logcnt_min"] >= 1
    assert "eplb affinity: placed 4 layers x 24 slots from 50 recorded tokens" in r.stderr  # not a fallback
