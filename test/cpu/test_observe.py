"""observe: stage recorder bookkeeping (CPU clock), hooks, dumps, Prometheus, detector, HTML report.

The detector is checked on synthetic recorded-like dumps (observe.synth) with injected faults
and on clean dumps over several seeds. The HTML report is rendered in headless Chromium when one
is on PATH (apt-get install -y chromium); otherwise that test is skipped, with the reason.
"""
import inspect
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sglang_h20 import compat
from sglang_h20.features import Feature, decide
from sglang_h20.observe import analyze, export, recorder, report, stages, synth
from sglang_h20.observe.recorder import OUTSIDE, CpuClock, StageRecorder, rank_loads, remote_share
from sglang_h20.settings import Settings

from repo_scripts import REPO

ON = Settings.from_env({"SGLANG_H20_OBSERVE": "0.25"})


# ----------------------------------------------------------------------------- fakes
class FakeClock:
    """Marks are the current fake time; streams are plain names ('main', 'alt')."""

    name = "fake"

    def __init__(self):
        self.now = 0.0
        self.cur = "main"
        self.pending_marks = set()

    def advance(self, ms):
        self.now += ms

    def mark(self):
        return self.now

    def ready(self, mark):
        return mark not in self.pending_marks

    def elapsed_ms(self, a, b):
        return b - a

    def stream(self):
        return self.cur

    def release(self, marks):
        pass


def _sum_record(rec):
    return sum(v for e in rec["layers"] for v in e["stages"].values()) + sum(rec["outside"].values())


# ----------------------------------------------------------------------------- recorder
def test_recorder_exclusive_attribution_with_overlap_and_nesting():
    clk = FakeClock()
    rec = StageRecorder(clock=clk, rank=3)
    rec.begin_step(100, {"mode": "decode"})
    clk.advance(0.5)  # embedding etc.
    lay = rec.push("layer", "layer_other", layer=7)
    clk.advance(0.2)  # input norm
    with rec.stage("attention"):
        clk.advance(3.0)
    moe = rec.push("moe", "moe_other")
    with rec.stage("router", "router"):
        clk.advance(1.0)
    clk.cur = "alt"  # shared experts on alt_stream: overlap, not critical path
    with rec.stage("shared", "shared_expert"):
        assert rec.push("dense", "dense_mlp") is None  # inside an off-stream frame: covered by it
        clk.advance(0.1)  # (host time; the alt stream runs concurrently)
    clk.cur = "main"
    exp = rec.push("experts", "dispatch")
    assert rec.top_kind() == "experts" and rec.inside("moe") and not rec.inside("routed")  # what no_nest reads
    clk.advance(2.0)
    with rec.stage("shared", "shared_expert"):  # SBO: shared experts inside dispatch, main stream
        clk.advance(0.7)
    clk.advance(0.3)
    with rec.stage("routed", "routed_experts", then="combine", then_parent="experts"):
        assert rec.push("routed", "routed_experts") is not None  # push itself does not dedupe
        rec.pop(rec._stack[-1])
        clk.advance(4.0)
    clk.advance(1.5)
    rec.pop(exp)
    clk.advance(0.25)
    rec.pop(moe)
    clk.advance(0.05)
    rec.pop(lay)
    clk.advance(0.4)  # final norm, logits
    rec.end_step()
    out = rec.poll()
    assert len(out) == 1
    r = out[0]
    assert r["kind"] == "stages" and r["rank"] == 3 and r["step"] == 100 and r["mode"] == "decode"
    (entry,) = r["layers"]
    s = entry["stages"]
    assert entry["layer"] == 7
    assert s["attention"] == pytest.approx(3.0)
    assert s["router"] == pytest.approx(1.0)
    assert s["dispatch"] == pytest.approx(2.3)  # SBO shared expert time taken out of dispatch
    assert s["shared_expert"] == pytest.approx(0.7)
    assert s["routed_experts"] == pytest.approx(4.0)
    assert s["combine"] == pytest.approx(1.5)
    assert s["moe_other"] == pytest.approx(0.35)  # incl. the main stream while shared was issued on alt
    assert s["layer_other"] == pytest.approx(0.25)
    assert entry["overlap"] == {"shared_expert": pytest.approx(0.1)}
    assert "overlap" not in r  # nothing ran off the main stream outside a layer
    assert r["outside"][OUTSIDE] == pytest.approx(0.9)
    assert r["step_ms"] == pytest.approx(clk.now)
    assert _sum_record(r) == pytest.approx(r["step_ms"], rel=1e-12)


def test_a_routed_frame_relabels_only_an_experts_parent():
    """Routed experts turn an experts frame from dispatch to combine; under any other parent (here the MoE frame
    itself) the time after them keeps the parent's label."""
    clk = FakeClock()
    rec = StageRecorder(clock=clk)
    rec.begin_step(1)
    lay = rec.push("layer", "layer_other", layer=0)
    moe = rec.push("moe", "moe_other")
    clk.advance(1.0)
    with rec.stage("routed", "routed_experts", then="combine", then_parent="experts"):
        clk.advance(2.0)
    clk.advance(0.5)
    rec.pop(moe)
    rec.pop(lay)
    rec.end_step()
    (r,) = rec.poll()
    assert r["layers"][0]["stages"] == {"moe_other": pytest.approx(1.5), "routed_experts": pytest.approx(2.0),
                                        "layer_other": 0.0}


def test_balancedness_of_an_unrouted_layer_is_one():
    """No tokens at all is balanced (SGLang's convention), not 0/0 and not 0."""
    assert recorder.balancedness([[0, 0, 0, 0], [1, 0, 0, 1]], 2, 2) == [1.0, 1.0]
    assert recorder.balancedness([0, 0, 0, 0], 2, 2) == 1.0


def test_a_rank_outside_the_expert_parallel_group_records_no_per_token_or_remote_share():
    """Rank 2 of an EP group of 2 (expert parallelism narrower than the TP group) hosts no experts: its record has
    the expert counts but neither share."""
    rec = StageRecorder(clock=FakeClock(), rank=2)
    rec.begin_step(1)
    rec.record_load(0, torch.tensor([[0, 3], [2, 1]]), num_experts=4, experts_per_rank=2, ep_size=2)
    rec.end_step()
    (r,) = rec.poll()
    assert r["expert_load"] == [[1, 1, 1, 1]]
    assert "token_leave_share" not in r and "remote_share" not in r


def test_off_stream_work_outside_any_layer_is_the_steps_overlap():
    """A frame on another stream with no layer around it (e.g. a side-stream copy between layers) is reported as the
    step's own overlap, not as a layer's, and takes nothing from the critical path."""
    clk = FakeClock()
    rec = StageRecorder(clock=clk)
    rec.begin_step(1)
    clk.advance(1.0)
    clk.cur = "alt"
    with rec.stage("copy", "weight_copy"):
        clk.advance(0.4)
    clk.cur = "main"
    clk.advance(0.6)
    rec.end_step()
    (r,) = rec.poll()
    assert r["overlap"] == {"weight_copy": pytest.approx(0.4)} and r["layers"] == []
    assert r["step_ms"] == pytest.approx(2.0) and _sum_record(r) == pytest.approx(2.0)


def test_rank_loads_by_expert_owner():
    """Expert e lives on rank e // experts_per_rank (ceil(P / ep_size) when not given); slots past the last rank's
    share stay on the last rank; one rank: the total."""
    assert rank_loads([[1, 2, 3, 4, 5, 6, 7]], 3, 3).tolist() == [[6, 15, 7]]
    assert rank_loads([1, 2, 3, 4, 5, 6, 7], 0, 2).tolist() == [10, 18]
    assert rank_loads([1] * 7, 2, 3).tolist() == [2, 2, 3]
    assert rank_loads([[1, 2], [3, 4]], 1, 1).tolist() == [[3], [7]]


def test_recorder_waits_for_events_and_survives_exceptions():
    clk = FakeClock()
    rec = StageRecorder(clock=clk, max_pending=2)
    rec.begin_step(1)
    f = rec.push("layer", "layer_other", layer=0)
    rec.push("attention", "attention")
    clk.advance(1.0)
    rec.pop(f)  # an exception skipped the attention pop: popping the layer closes both
    clk.advance(1.0)
    rec.end_step()
    clk.pending_marks.add(clk.now)  # last event not complete yet: nothing comes out, no sync
    assert rec.poll() == [] and rec.pending() == 1
    clk.pending_marks.clear()
    (r,) = rec.poll()
    assert {k: v for k, v in r["layers"][0]["stages"].items() if v} == {"attention": pytest.approx(1.0)}
    assert _sum_record(r) == pytest.approx(r["step_ms"])
    # a discarded step (the forward raised) leaves nothing behind
    rec.begin_step(2)
    rec.end_step(discard=True)
    assert rec.poll() == [] and not rec.active
    # pushes outside a step are no-ops
    assert rec.push("attention", "attention") is None


class _PerfCounter:
    """The `time` module as CpuClock sees it: perf_counter is a virtual clock that moves by the workload's
    sleeps plus 10 us per reading (the recorder's own bookkeeping); everything else is the real module."""

    def __init__(self):
        self.now = 100.0

    def perf_counter(self) -> float:
        self.now += 1e-5
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s

    def __getattr__(self, name):
        return getattr(time, name)


def test_recorder_cpu_clock_sums_match_step_time(monkeypatch):
    """CpuClock (perf_counter marks) on a layered workload: stages sum to the step, and each is its sleep.

    perf_counter is virtual here: with real sleeps on a loaded 2-core CI host a stage can overshoot its sleep
    by any amount of scheduler delay, and a wall-clock bound on it (or on the coverage) fails by chance."""
    clk = _PerfCounter()
    monkeypatch.setattr(recorder, "time", clk)
    rec = StageRecorder(clock=CpuClock())
    plan = {"attention": 0.004, "router": 0.001, "dispatch": 0.002, "routed_experts": 0.003, "combine": 0.002}
    rec.begin_step(5)
    for layer in range(3):
        lay = rec.push("layer", "layer_other", layer=layer)
        with rec.stage("attention"):
            clk.sleep(plan["attention"])
        moe = rec.push("moe", "moe_other")
        with rec.stage("router", "router"):
            clk.sleep(plan["router"])
        exp = rec.push("experts", "dispatch")
        clk.sleep(plan["dispatch"])
        with rec.stage("routed", "routed_experts", then="combine", then_parent="experts"):
            clk.sleep(plan["routed_experts"])
        clk.sleep(plan["combine"])
        rec.pop(exp)
        rec.pop(moe)
        rec.pop(lay)
    rec.end_step()
    (r,) = rec.poll()
    assert r["clock"] == "cpu"
    assert _sum_record(r) == pytest.approx(r["step_ms"], rel=1e-9)
    for e in r["layers"]:
        for stage, sec in plan.items():
            got = e["stages"][stage]
            assert sec * 1e3 <= got <= sec * 1e3 + 0.05, (stage, got)  # its sleep plus a few 10 us readings
    assert r["step_ms"] == pytest.approx(3 * sum(plan.values()) * 1e3, abs=2.0)
    assert r["cpu_ms"] == pytest.approx(r["step_ms"], abs=0.1)  # host time from begin_step to end_step, in ms
    assert 0.9 < r["coverage"] <= 1.0


def test_record_load_counts_and_balancedness():
    rec = StageRecorder(clock=FakeClock())
    rec.begin_step(1)
    ids = torch.tensor([[0, 5], [5, 7], [-1, -1], [3, 5]])  # padded row -1
    rec.record_load(4, ids, num_experts=8, experts_per_rank=2, ep_size=4)
    rec.record_load(4, torch.tensor([[1, 9]]), num_experts=8, experts_per_rank=2, ep_size=4)  # 9: not routed
    rec.end_step()
    (r,) = rec.poll()
    assert r["expert_load_layers"] == [4]
    assert r["expert_load"] == [[1, 1, 0, 1, 0, 3, 0, 1]]
    per_rank = [2, 1, 3, 1]
    assert r["balancedness"][0] == pytest.approx(np.mean(per_rank) / max(per_rank))
    assert (r["num_experts"], r["experts_per_rank"], r["ep_size"]) == (8, 2, 4)
    # rank 0 holds experts 0-1: 2 of its 7 routed pairs stay, 5 leave the GPU
    assert r["remote_share"] == [pytest.approx(5 / 7)]
    # per token: 4 routed ([0,5] [5,7] [3,5] [1,9]), 3 with an expert elsewhere, sent to 1 + 2 + 2 other GPUs
    assert r["token_leave_share"] == [pytest.approx(3 / 4)] and r["remote_copies_per_token"] == [pytest.approx(5 / 4)]
    assert "token_counts" not in r
    one = StageRecorder(clock=FakeClock())  # one GPU: no per-token counts, expert counts as they were
    one.begin_step(1)
    one.record_load(2, ids, num_experts=8)
    one.end_step()
    (r1,) = one.poll()
    assert r1["expert_load"] == [[1, 0, 0, 1, 0, 3, 0, 1]] and "token_leave_share" not in r1
    assert r1["ep_size"] == 1 and r1["balancedness"] == [1.0] and "remote_share" not in r1  # one GPU by default
    two = StageRecorder(clock=FakeClock(), rank=1)  # the smallest expert-parallel group has a remote share too
    two.begin_step(1)
    two.record_load(0, torch.tensor([[0, 3], [2, 1]]), num_experts=4, experts_per_rank=2, ep_size=2)
    two.end_step()
    assert two.poll()[0]["remote_share"] == [pytest.approx(2 / 4)]  # rank 1 holds experts 2-3
    assert remote_share([[0, 0, 3, 1], [2, 0, 0, 0]], 2, 2, rank=1) == [0.0, 1.0]
    assert remote_share([[0, 0, 0, 0]], 2, 2, rank=0) == [0.0]  # nothing routed


# ----------------------------------------------------------------------------- hooks on a fake runner
class _FakeGraphRunner:
    def can_run_graph(self, forward_batch):
        return True


class _Attn:
    def forward(self, x):
        time.sleep(0.002)
        return x


class _Gate:
    def forward(self, x):
        time.sleep(0.0005)
        return x


class _TopK:
    def forward(self, x, logits):
        return SimpleNamespace(topk_ids=torch.tensor([[1, 2], [2, 3]]))


class _Experts:
    num_experts, num_local_experts, moe_ep_size = 4, 2, 2

    def forward_impl(self, x, topk):
        time.sleep(0.001)  # dispatch
        y = self.run_moe_core(x)
        time.sleep(0.001)  # combine
        return y

    def run_moe_core(self, x):
        time.sleep(0.0015)
        return x


class _MoE:
    is_nextn = False

    def __init__(self):
        self.gate, self.topk, self.experts = _Gate(), _TopK(), _Experts()

    def forward(self, x):
        logits = self.gate.forward(x)
        shared = self._forward_shared_experts(x)
        out = self.experts.forward_impl(x, self.topk.forward(x, logits))
        return out + shared

    def _forward_shared_experts(self, x):
        time.sleep(0.0005)
        return 0


class _Layer:
    def __init__(self, i):
        self.layer_id, self.attn, self.mlp = i, _Attn(), _MoE()

    def forward(self, x):
        return self.mlp.forward(self.attn.forward(x))


class _Runner:
    is_draft_worker = False

    def __init__(self, layers=2):
        self.forward_pass_id = 0
        self.decode_cuda_graph_runner = _FakeGraphRunner()
        self.layers = [_Layer(i) for i in range(layers)]
        self.eager_passes = []

    def forward(self, forward_batch):
        self.forward_pass_id += 1
        if self.decode_cuda_graph_runner.can_run_graph(forward_batch):
            return SimpleNamespace(can_run_graph=True)  # replay: no Python runs per layer
        self.eager_passes.append(self.forward_pass_id)
        x = 1
        for layer in self.layers:
            x = layer.forward(x)
        return SimpleNamespace(can_run_graph=False)


@pytest.fixture
def wrapped_fakes(monkeypatch):
    """The fakes' methods wrapped exactly as SGLang's HookRegistry wraps AROUND hooks."""
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    pairs = [(_Runner, "forward", stages.on_model_runner_forward),
             (_FakeGraphRunner, "can_run_graph", stages.on_can_run_graph),
             (_Layer, "forward", stages.on_decoder_layer), (_Attn, "forward", stages.on_attention),
             (_MoE, "forward", stages.on_moe), (_Gate, "forward", stages.on_gate),
             (_TopK, "forward", stages.on_topk), (_MoE, "_forward_shared_experts", stages.on_shared),
             (_Experts, "forward_impl", stages.on_experts), (_Experts, "run_moe_core", stages.on_routed)]
    for cls, name, fn in pairs:
        monkeypatch.setattr(cls, name, _wrap_fn(cls.__dict__[name], fn, HookType.AROUND))
    stages.reset_state()
    yield
    stages.reset_state()


def test_frame_hooks_open_one_frame_per_kind_and_no_dense_frame_inside_a_moe(monkeypatch):
    """DeepEP's MoE runs FusedMoE's methods inside its own (both hooked): one experts / routed frame, not two.
    DeepseekV2MLP is both a dense layer's MLP and the MoE's shared experts: a frame of its own only outside a MoE."""
    clk = FakeClock()
    rec = StageRecorder(clock=clk)
    rec.begin_step(1)
    monkeypatch.setattr(stages, "_ACTIVE", rec)
    kinds = lambda: [f.kind for f in rec._stack][1:]  # below the step's root frame
    seen = {}
    lay = rec.push("layer", "layer_other", layer=0)
    stages.on_dense(lambda: seen.setdefault("dense", kinds()))
    moe = rec.push("moe", "moe_other")
    stages.on_dense(lambda: seen.setdefault("shared_mlp", kinds()))
    stages.on_experts(lambda: stages.on_experts(lambda: stages.on_routed(
        lambda: stages.on_routed(lambda: seen.setdefault("routed", kinds())))))
    rec.pop(moe)
    rec.pop(lay)
    assert seen == {"dense": ["layer", "dense"], "shared_mlp": ["layer", "moe"],
                    "routed": ["layer", "moe", "experts", "routed"]}


def test_batch_meta_counts_tokens_only_from_a_tensor():
    """input_ids without a shape (a list from an odd batch) give no token count rather than an error."""
    fb = SimpleNamespace(batch_size=3, input_ids=torch.zeros(7, dtype=torch.long))
    assert stages._batch_meta(fb, "decode") == {"mode": "decode", "eager": True, "batch_size": 3, "num_tokens": 7}
    fb.input_ids = [1, 2, 3]
    assert stages._batch_meta(fb, "decode") == {"mode": "decode", "eager": True, "batch_size": 3}


class _ListExporter:
    def __init__(self):
        self.records = []

    def emit(self, r):
        self.records.append(r)


def test_hooks_sample_eagerly_and_keep_graphs_otherwise(wrapped_fakes):
    exp = _ListExporter()
    stages.configure(0.25, exporter=exp, recorder=StageRecorder(clock=CpuClock(), rank=0))
    runner = _Runner()
    decode = SimpleNamespace(forward_mode=SimpleNamespace(name="DECODE"), batch_size=2,
                             input_ids=torch.zeros(2))
    for _ in range(12):
        runner.forward(decode)
    runner.forward(SimpleNamespace(forward_mode=SimpleNamespace(name="EXTEND")))  # pass 13: drains
    # period 4: passes 4, 8, 12 sampled eagerly; 2, 6, 10 graph references; the rest replayed graphs
    assert runner.eager_passes == [4, 8, 12]
    kinds = [(r["kind"], r["step"]) for r in exp.records]
    assert kinds == [("graph", 2), ("stages", 4), ("graph", 6), ("stages", 8), ("graph", 10), ("stages", 12)]
    for r in exp.records:
        if r["kind"] != "stages":
            continue
        assert r["graph_would_run"] is True and r["eager"] is True and r["batch_size"] == 2
        assert [e["layer"] for e in r["layers"]] == [0, 1]
        for e in r["layers"]:
            s = e["stages"]
            assert set(s) >= {"attention", "router", "dispatch", "routed_experts", "combine", "shared_expert"}
            assert s["attention"] >= 2.0 and s["routed_experts"] >= 1.5 and s["dispatch"] >= 1.0
        assert _sum_record(r) == pytest.approx(r["step_ms"], rel=1e-9)
        assert r["expert_load"] == [[0, 1, 2, 1], [0, 1, 2, 1]]
        assert (r["num_experts"], r["experts_per_rank"], r["ep_size"]) == (4, 2, 2)
    assert not stages._state.force_eager and stages._ACTIVE is None


def test_hooks_skip_the_nextn_layers_load_quietly(wrapped_fakes, caplog):
    """The MTP draft layer (is_nextn) routes too, but its load is not the model's: skipped, without a warning."""
    exp = _ListExporter()
    stages.configure(1.0, exporter=exp, recorder=StageRecorder(clock=CpuClock(), rank=0))
    runner = _Runner()
    runner.layers[1].mlp.is_nextn = True
    decode = SimpleNamespace(forward_mode=SimpleNamespace(name="DECODE"), batch_size=2, input_ids=torch.zeros(2))
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            runner.forward(decode)
        runner.forward(SimpleNamespace(forward_mode=SimpleNamespace(name="EXTEND")))
    recs = [r for r in exp.records if r["kind"] == "stages"]
    assert recs and all(r["expert_load_layers"] == [0] and r["expert_load"] == [[0, 1, 2, 1]] for r in recs)
    assert "not recorded" not in caplog.text


class _Mark:
    """A timing event of a fake graph: capture creates it, every replay of its graph re-stamps it."""

    def __init__(self):
        self.t, self.done = time.perf_counter(), True


class _ReplayClock(CpuClock):
    name = "fake_graph"

    def __init__(self):
        self.capturing = None  # the list a capture collects its marks into

    def mark(self):
        m = _Mark()
        if self.capturing is not None:
            self.capturing.append(m)
        return m

    def ready(self, mark) -> bool:
        return mark.done

    def elapsed_ms(self, a, b) -> float:
        return (b.t - a.t) * 1e3


class _CapturingGraphRunner(_FakeGraphRunner):
    """Captures by running the forward once with the stage hooks live; a replay runs no Python except
    re-stamping the events its capture recorded (0.5 ms apart), as a CUDA graph's event nodes would."""

    def __init__(self, clock, monkeypatch):
        self.clock, self.graphs, self.replays, self.mp = clock, {}, [], monkeypatch
        self.backend = type("FullCudaGraphBackend", (), {})()  # the backend kind twins are made for

    def capture_one_shape(self, size, forward, stream_idx=None, variant_label=None):
        marks = self.clock.capturing = []
        self.mp.setattr(stages, "_capturing", lambda: True)
        try:
            forward(1)
        finally:  # torch.cuda.graph ends the capture on an exception too
            self.mp.setattr(stages, "_capturing", lambda: False)
            self.clock.capturing = None
        self.graphs[self._make_graph_key(size, stream_idx, variant_label)] = marks

    def _make_graph_key(self, size, stream_idx=None, variant_label=None):
        return (size, stream_idx, variant_label)

    def replay(self, key):
        self.replays.append(key)
        for m in self.graphs[key]:
            time.sleep(0.0005)
            m.t, m.done = time.perf_counter(), True


def test_a_graph_samples_load_counts_are_copied_right_after_its_replay():
    """A twin's load counts live in the graph pool, where the plain graph captured before it may have left
    temporaries: a plain replay before the sample is read overwrites them, so they are copied out at once."""
    clock = _ReplayClock()
    rec = StageRecorder(clock=clock, rank=0)
    clock.capturing = []
    rec.begin_step(0)
    rec.record_load(0, torch.tensor([[0, 2], [1, 2]]), num_experts=3)
    rec.end_step(template=True)
    clock.capturing = None
    tmpl = rec.take_template()
    rec.queue_graph_sample(tmpl, 7, {}, clock.mark())  # right after the twin's replay
    for t in tmpl.sample.loads.values():
        t.fill_(-7)  # a plain replay reusing the pool, before the sample is read
    [r] = rec.poll()
    assert r["step"] == 7 and r["expert_load"] == [[1, 1, 2]] and r["window_ms"] >= 0


class _GraphRunner(_Runner):
    def __init__(self, graph_runner, layers=2):
        super().__init__(layers)
        self.decode_cuda_graph_runner = graph_runner

    def model_forward(self, x):
        for layer in self.layers:
            x = layer.forward(x)
        return x

    def forward(self, forward_batch):
        self.forward_pass_id += 1
        gr = self.decode_cuda_graph_runner
        if gr.can_run_graph(forward_batch):
            gr.replay(gr._make_graph_key(forward_batch.batch_size))
            return SimpleNamespace(can_run_graph=True)
        self.eager_passes.append(self.forward_pass_id)
        self.model_forward(1)
        return SimpleNamespace(can_run_graph=False)


@pytest.fixture
def twin_fakes(wrapped_fakes, monkeypatch):
    """A graph runner that captures and replays fake graphs, hooked like the real one; (runner, graphs, exporter)."""
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    for cls, name, fn in ((_CapturingGraphRunner, "capture_one_shape", stages.on_capture_one_shape),
                          (_CapturingGraphRunner, "_make_graph_key", stages.on_make_graph_key),
                          (_GraphRunner, "forward", stages.on_model_runner_forward)):
        monkeypatch.setattr(cls, name, _wrap_fn(cls.__dict__[name], fn, HookType.AROUND))
    clock, exp = _ReplayClock(), _ListExporter()
    stages.configure(0.25, exporter=exp, recorder=StageRecorder(clock=clock, rank=0))
    stages._state.graph_clock = lambda: clock
    gr = _CapturingGraphRunner(clock, monkeypatch)
    return _GraphRunner(gr), gr, exp


def test_sampled_passes_replay_an_instrumented_graph_twin(twin_fakes):
    """With instrumented twins captured, a sampled pass replays its batch size's twin (no eager pass) and
    its stages come from the twin's events; a twin whose sample is unread is not replayed again."""
    runner, gr, exp = twin_fakes
    for size in (4, 2):
        gr.capture_one_shape(size, runner.model_forward)
    assert set(gr.graphs) == {(4, None, None), (2, None, None), (4, None, "h20_observe"), (2, None, "h20_observe")}
    assert gr.graphs[(2, None, None)] == [] and len(gr.graphs[(2, None, "h20_observe")]) > 10
    decode = SimpleNamespace(forward_mode=SimpleNamespace(name="DECODE"), batch_size=2, input_ids=torch.zeros(2))
    for _ in range(8):
        runner.forward(decode)
    runner.forward(SimpleNamespace(forward_mode=SimpleNamespace(name="EXTEND"), batch_size=2))  # drains
    assert runner.eager_passes == []  # sampled passes 4 and 8 replayed the twin instead of running eagerly
    assert gr.replays.count((2, None, "h20_observe")) == 2 and len(gr.replays) == 9
    stage_recs = [r for r in exp.records if r["kind"] == "stages"]
    assert [r["step"] for r in stage_recs] == [4, 8]
    for r in stage_recs:
        assert r["eager"] is False and r["graph_sampled"] is True and r["graph_size"] == 2
        assert [e["layer"] for e in r["layers"]] == [0, 1]
        assert set(r["layers"][0]["stages"]) >= {"attention", "router", "dispatch", "routed_experts", "combine"}
        assert _sum_record(r) == pytest.approx(r["step_ms"], rel=1e-9)
        assert r["window_ms"] >= r["step_ms"] > 0  # timed from outside the replay too
        assert r["expert_load"] == [[0, 1, 2, 1], [0, 1, 2, 1]]
    # the twin of size 2 is in flight until drained: a sampled pass meanwhile replays the plain graph
    tmpl = stages._state.templates[(id(gr), 2, None)]
    assert not tmpl.in_flight
    tmpl.in_flight = True
    for _ in range(4):
        runner.forward(decode)
    assert gr.replays[-4:] == [(2, None, None)] * 4 and runner.eager_passes == []


def test_no_twins_for_segmented_graph_backends(wrapped_fakes, monkeypatch, caplog):
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    monkeypatch.setattr(_CapturingGraphRunner, "capture_one_shape", _wrap_fn(
        _CapturingGraphRunner.__dict__["capture_one_shape"], stages.on_capture_one_shape, HookType.AROUND))
    clock = _ReplayClock()
    stages.configure(0.25, exporter=_ListExporter(), recorder=StageRecorder(clock=clock, rank=0))
    gr = _CapturingGraphRunner(clock, monkeypatch)
    gr.backend = type("BreakableCudaGraphBackend", (), {})()
    with caplog.at_level("WARNING"):
        gr.capture_one_shape(2, _GraphRunner(gr).model_forward)
    assert list(gr.graphs) == [(2, None, None)] and not stages._state.templates
    assert "BreakableCudaGraphBackend" in caplog.text


def test_a_failed_twin_capture_falls_back_to_eager_sampling(twin_fakes, caplog):
    runner, gr, exp = twin_fakes

    def broken(x):  # the plain capture works; the twin's (stage hooks live) fails
        if stages._capturing() and stages._ACTIVE is not None:
            raise RuntimeError("operation not permitted when stream is capturing")
        return runner.model_forward(x)

    with caplog.at_level("WARNING"):
        gr.capture_one_shape(2, broken)
    assert "instrumented graph capture failed" in caplog.text and not stages._state.graph_samples
    decode = SimpleNamespace(forward_mode=SimpleNamespace(name="DECODE"), batch_size=2, input_ids=torch.zeros(2))
    for _ in range(4):
        runner.forward(decode)
    assert runner.eager_passes == [4]  # the eager path samples as before


def test_hooks_leave_draft_runners_and_off_switch_alone(wrapped_fakes):
    exp = _ListExporter()
    stages.configure(1.0, exporter=exp, recorder=StageRecorder(clock=CpuClock()))
    runner = _Runner()
    runner.is_draft_worker = True
    decode = SimpleNamespace(forward_mode=SimpleNamespace(name="DECODE"))
    for _ in range(3):
        runner.forward(decode)
    assert runner.eager_passes == [] and exp.records == []
    stages.configure(0.0, exporter=exp, recorder=StageRecorder(clock=CpuClock()))
    runner.is_draft_worker = False
    for _ in range(3):
        runner.forward(decode)
    assert runner.eager_passes == [] and exp.records == []


def test_control_file_reads_only_changes_and_ignores_bad_values(tmp_path):
    path = tmp_path / "control"
    ctl = stages.Control(str(path), every=8)
    assert ctl.read() is None  # missing: keep the current fraction
    path.write_text("0.01\n")
    assert ctl.read() == 0.01
    assert ctl.read() is None  # unchanged (same mtime and size): not read again
    path.write_text("0")
    assert ctl.read() == 0.0
    for bad in ("2", "abc", ""):
        path.write_text(bad)
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 1))
        assert ctl.read() is None
    assert [p for p in range(1, 33) if ctl.due(p)] == [8, 16, 24, 32]


def _decode_batch():
    return SimpleNamespace(forward_mode=SimpleNamespace(name="DECODE"), batch_size=2, input_ids=torch.zeros(2))


def _set_control(path, value):
    path.write_text(f"{value}\n")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 1))  # a new mtime even within one clock tick


def test_control_file_flips_sampling_at_due_passes_only(wrapped_fakes, tmp_path):
    path = tmp_path / "control"
    _set_control(path, 0)
    exp = _ListExporter()
    stages.configure(0.25, exporter=exp, recorder=StageRecorder(clock=CpuClock()),
                     control=stages.Control(str(path), every=4))
    runner = _Runner()
    for _ in range(10):  # 1-3 at 0.25 from the env (pass 2: graph reference), 4: control says 0
        runner.forward(_decode_batch())
    assert runner.eager_passes == [] and [r["step"] for r in exp.records] == [2]
    _set_control(path, 0.5)  # period 2, applied at pass 12
    for _ in range(6):  # passes 11..16
        runner.forward(_decode_batch())
    assert runner.eager_passes == [12, 14, 16]
    _set_control(path, 0)  # off again from pass 20: graphs answer as upstream
    for _ in range(8):  # 17..24
        runner.forward(_decode_batch())
    assert runner.eager_passes == [12, 14, 16, 18]
    assert stages._state.sampler.period == 0 and not stages._state.force_eager
    assert runner.decode_cuda_graph_runner.can_run_graph(_decode_batch()) is True
    steps = sorted(r["step"] for r in exp.records if r["kind"] == "stages")
    assert steps == [12, 14, 16, 18]  # drained while off too
    assert stages._state.recorder.pending() == 0


def test_control_file_applies_at_the_due_pass_itself(wrapped_fakes, tmp_path):
    """A change is read at the first pass whose id is a multiple of `every` (the id forward() is about to give it),
    and that pass already runs with it: at every=4 a 1.0 written after pass 10 samples from pass 12 on."""
    path = tmp_path / "control"
    _set_control(path, 0)
    stages.configure(0, exporter=_ListExporter(), recorder=StageRecorder(clock=CpuClock()),
                     control=stages.Control(str(path), every=4))
    runner = _Runner()
    for _ in range(10):
        runner.forward(_decode_batch())
    _set_control(path, 1.0)
    for _ in range(3):  # passes 11..13
        runner.forward(_decode_batch())
    assert runner.eager_passes == [12, 13]


def test_after_an_error_forward_passes_leave_the_recorder_alone(wrapped_fakes):
    """Once observation turned itself off after an error, a pass runs upstream's forward and nothing else: the
    recorder that may have failed is not drained again, even with samples still pending."""
    class BrokenRecorder(StageRecorder):
        def pending(self):
            return 1

        def poll(self):
            raise AssertionError("drained after the error")

    exp = _ListExporter()
    stages.configure(0.5, exporter=exp, recorder=BrokenRecorder(clock=CpuClock()))
    stages._disable("an earlier pass", RuntimeError("sync failed"))
    runner = _Runner()
    for _ in range(4):
        assert runner.forward(_decode_batch()).can_run_graph is True
    assert runner.eager_passes == [] and exp.records == []
    assert stages._state.disabled == "an earlier pass: RuntimeError: sync failed"


def test_control_file_value_comes_from_rank_zero_on_every_rank(wrapped_fakes, tmp_path, monkeypatch):
    """A rank other than 0 never reads the file: it takes rank 0's value from a broadcast, at the
    same due pass, even while observation is off, so all ranks switch together."""
    import torch.distributed as dist

    calls = []

    def fake_broadcast(box, src, group):
        calls.append((box[0], src, group))
        box[0] = 0.5  # what rank 0 read

    monkeypatch.setattr(dist, "broadcast_object_list", fake_broadcast)
    path = tmp_path / "control"
    _set_control(path, 0)  # this rank would read 0: it must not
    stages.configure(0.25, exporter=_ListExporter(), recorder=StageRecorder(clock=CpuClock()),
                     control=stages.Control(str(path), every=4))
    runner = _Runner()
    runner.tp_group = SimpleNamespace(world_size=2, rank_in_group=1, ranks=[10, 11], cpu_group="gloo")
    for _ in range(8):
        runner.forward(_decode_batch())
    assert calls == [(None, 10, "gloo"), (None, 10, "gloo")]  # passes 4 and 8, src = global rank of 0
    assert stages._state.sampler.fraction == 0.5 and runner.eager_passes == [4, 6, 8]


def test_control_switch_reaches_the_hooks(tmp_path):
    env = {"SGLANG_H20_OBSERVE": "0.01", "SGLANG_H20_OBSERVE_CONTROL": str(tmp_path / "c")}
    settings = Settings.from_env(env)
    assert settings["observe_control"] == str(tmp_path / "c") and not settings.errors
    stages.hooks(settings)
    assert stages._state.control.path == str(tmp_path / "c")
    stages.hooks(ON)
    assert stages._state.control is None
    stages.reset_state()


def test_sampler_is_deterministic_and_rank_independent():
    a, b = stages.Sampler(0.01), stages.Sampler(0.01)
    picks = [p for p in range(1, 1001) if a.decide(p) == "stages"]
    assert picks == [p for p in range(1, 1001) if b.decide(p) == "stages"] == list(range(100, 1001, 100))
    assert [p for p in range(1, 301) if a.decide(p) == "graph"] == [50, 150, 250]
    assert stages.Sampler(1.0).decide(7) == "stages" and stages.Sampler(0).decide(100) is None
    # the shortest period with a graph reference: every other pass, alternating with the sampled ones
    assert [stages.Sampler(0.5).decide(p) for p in range(1, 5)] == ["graph", "stages", "graph", "stages"]
    assert {stages.Sampler(1.0).decide(p) for p in range(1, 5)} == {"stages"}  # period 1: no pass left for one


# ----------------------------------------------------------------------------- hook targets
def test_every_hook_target_resolves():
    hooks = stages.hooks(ON)
    targets = [h.target for h in hooks]
    assert len(targets) == len(set(targets)) == 15
    for h in hooks:
        assert h.kind in ("before", "after", "around", "replace")
        ok, why = compat.check_target(h.target)
        assert ok, why
    stages.reset_state()


def test_hooked_signatures_match_what_the_hooks_assume():
    import pkgutil

    for target, first in ((stages.STEP_TARGET, ["self", "forward_batch"]),
                          (stages.GRAPH_TARGET, ["self", "forward_batch"]),
                          (stages.CAPTURE_TARGET, ["self", "size", "forward", "stream_idx", "variant_label"]),
                          (stages.KEY_TARGET, ["self", "size", "stream_idx", "variant_label"]),
                          (stages.LAYER_TARGET, ["self", "positions", "hidden_states"])):
        fn = inspect.unwrap(pkgutil.resolve_name(target))
        assert list(inspect.signature(fn).parameters)[: len(first)] == first, target
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    assert "topk_ids" in StandardTopKOutput._fields
    # the twins: a variant label in the graph key, and the one-graph-per-shape backend by its name
    from sglang.srt.model_executor.runner.shape_key import ShapeKey
    from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import FullCudaGraphBackend

    assert ShapeKey(size=2, stream_idx=None, variant_label=stages.GRAPH_VARIANT).variant_label == "h20_observe"
    assert FullCudaGraphBackend.__name__ in stages.TWIN_BACKENDS
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    src = inspect.getsource(FusedMoE.forward_impl)  # dispatch -> run_moe_core -> combine, in that order
    assert src.index("dispatcher.dispatch(") < src.index("self.run_moe_core(") < src.index("dispatcher.combine(")


def test_feature_decides_on_with_all_hooks():
    feature = Feature("observe", "observe", "sglang_h20.observe.stages", needs_gpu=False)
    d = decide(feature, ON)
    assert d.on, d.reason
    assert len(d.hooks) == 15
    off = decide(feature, Settings.from_env({"SGLANG_H20_OBSERVE": "0"}))
    assert not off.on and "switched off" in off.reason
    stages.reset_state()


def test_hooks_apply_to_the_real_classes():
    """In a fresh process: SGLang's HookRegistry patches every target (inherited TopK.forward too)."""
    code = """
import pkgutil
from sglang.srt.plugins.hook_registry import HookRegistry, HookType
from sglang_h20.observe import stages
from sglang_h20.settings import Settings
hooks = stages.hooks(Settings.from_env({"SGLANG_H20_OBSERVE": "0.01"}))
for h in hooks:
    HookRegistry.register(h.target, h.fn, HookType(h.kind))
HookRegistry.apply_hooks()
bad = [h.target for h in hooks if h.target not in HookRegistry._patched
       or getattr(pkgutil.resolve_name(h.target), "__wrapped__", None) is None]
from sglang.srt.layers.moe.topk import TopK
from sglang.srt.layers.utils.multi_platform import MultiPlatformOp
assert MultiPlatformOp.forward is not TopK.forward  # only TopK is wrapped
print("BAD", bad)
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "BAD []" in p.stdout, p.stdout + p.stderr[-2000:]


# ----------------------------------------------------------------------------- dumps and export
def test_dump_round_trip_and_rotation(tmp_path):
    recs = synth.synthesize(ranks=4, layers=6, steps=3, seed=1, experts=16, first_dense=1)
    path = export.write_dump(tmp_path / "d.jsonl", recs)
    assert export.read_dump(path) == sorted(recs, key=lambda r: (r["step"], r["rank"], r["kind"]))
    with open(path, "a") as fh:
        fh.write('{"kind": "stages", "rank": 0, "ste')  # a process killed mid-line
    errors = []
    assert len(export.read_dump(path, errors)) == len(recs) and len(errors) == 1
    with open(path, "a") as fh:  # JSON, but not a record: each skipped and named
        fh.write('\n{"step": 1}\n{"rank": 0}\n[1, 2]\n')
    errors = []
    assert len(export.read_dump(path, errors)) == len(recs)
    assert len(errors) == 4 and sum(e.endswith("not an observe record") for e in errors) == 3
    w = export.JsonlWriter(tmp_path / "dir", rank=2, max_bytes=4000, keep=2)
    for r in recs:
        w.write(r)
    w.close()
    files = export.dump_files(tmp_path / "dir")
    assert {f.name for f in files} <= {"observe-rank002.jsonl", "observe-rank002.jsonl.1", "observe-rank002.jsonl.2"}
    assert len(files) == 3  # rotated, oldest dropped
    back = export.read_dump(tmp_path / "dir")
    assert 0 < len(back) < len(recs) and all(r in recs for r in back)
    # keep=0: rotation drops the full file, no numbered copies; a line longer than max_bytes still lands whole
    w = export.JsonlWriter(tmp_path / "none", rank=0, max_bytes=60, keep=0)
    for i in range(5):
        w.write({"step": i, "rank": 0, "pad": "x" * 80})
    w.close()
    assert [f.name for f in (tmp_path / "none").iterdir()] == ["observe-rank000.jsonl"]
    assert export.read_dump(tmp_path / "none") == [{"step": 4, "rank": 0, "pad": "x" * 80, "kind": "stages"}]
    big = export.JsonlWriter(tmp_path / "big", rank=0, max_bytes=10, keep=2)
    big.write({"step": 0, "rank": 0})  # longer than max_bytes, but the file is empty: nothing to rotate
    big.close()
    assert [f.name for f in (tmp_path / "big").iterdir()] == ["observe-rank000.jsonl"]
    line = len('{"step":0,"rank":0}\n')  # 20 bytes: two fill a 40-byte file exactly, a third rotates it
    full = export.JsonlWriter(tmp_path / "full", rank=0, max_bytes=2 * line, keep=1)
    full.close()  # closing a writer that never wrote, and closing twice, are no-ops
    for i in range(3):
        full.write({"step": i % 10, "rank": 0})
    full.close()
    full.close()
    assert [[r["step"] for r in export.read_dump(f)] for f in sorted((tmp_path / "full").iterdir())] == [[2], [0, 1]]


def test_rotation_shifts_numbered_copies_newest_first_and_errors_name_their_line(tmp_path, monkeypatch):
    """One record per file (each write rotates): `.1` is the newest full file, `.keep` the oldest kept, at keep 1 and
    3; a bad line's error names its 1-based line number; without SGLang's observability context, --enable-metrics is
    read from the PROMETHEUS_MULTIPROC_DIR its launcher sets."""
    for keep in (1, 3):
        w = export.JsonlWriter(tmp_path / f"k{keep}", rank=0, max_bytes=30, keep=keep)
        for i in range(6):
            w.write({"step": i, "rank": 0})
        w.close()
        files = {f.name: export.read_dump(f) for f in (tmp_path / f"k{keep}").iterdir()}
        want = {"observe-rank000.jsonl": 5, **{f"observe-rank000.jsonl.{n}": 5 - n for n in range(1, keep + 1)}}
        assert {name: [r["step"] for r in recs] for name, recs in files.items()} == {
            name: [step] for name, step in want.items()}
    path = export.write_dump(tmp_path / "e.jsonl", [{"step": 0, "rank": 0}, {"step": 1, "rank": 0}])
    with open(path, "a") as fh:
        fh.write("not json\n")
    errors = []
    export.read_dump(path, errors)
    assert len(errors) == 1 and errors[0].startswith(f"{path}:3: ")
    import sglang.srt.runtime_context as rc

    def no_context():
        raise RuntimeError("no observability context in this process")
    monkeypatch.setattr(rc, "get_observability", no_context, raising=False)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert export.metrics_enabled() is False
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert export.metrics_enabled() is True


def test_stage_totals_sum_layers_overlap_and_outside():
    rec = {"layers": [{"layer": 0, "stages": {"attention": 1.0, "combine": 0.5}, "overlap": {"shared_expert": 0.25}},
                      {"layer": 1, "stages": {"attention": 2.0}, "overlap": {"shared_expert": 0.5}}],
           "outside": {"outside_layers": 0.75}}
    assert export.stage_totals(rec) == {"attention": 3.0, "combine": 0.5, "overlap:shared_expert": 0.75,
                                        "outside_layers": 0.75}


class _FakeMetric:
    def __init__(self, kind, name, doc, labelnames=(), **kw):
        self.kind, self.name, self.kw, self.labelnames = kind, name, kw, list(labelnames)
        self.values = {}

    def labels(self, **labels):
        assert sorted(labels) == sorted(self.labelnames), (self.name, labels)
        key = tuple(sorted(labels.items()))
        metric = self

        class _Child:
            def set(self, v):
                metric.values[key] = v

            def inc(self, v=1):
                metric.values[key] = metric.values.get(key, 0) + v

            def observe(self, v):
                metric.values.setdefault(key, []).append(v)

        return _Child()


def _fake_prom(made: dict, gauge_refuses: Exception | None = None) -> SimpleNamespace:
    """A prometheus_client stand-in whose metrics land in `made` by name; with gauge_refuses, a Gauge asked for
    multiprocess mode "mostrecent" raises it."""
    def factory(kind, refuse=None):
        def make(name, doc, **kw):
            if refuse is not None and kw.get("multiprocess_mode") == "mostrecent":
                raise refuse
            made[name] = _FakeMetric(kind, name, doc, **kw)
            return made[name]
        return make

    return SimpleNamespace(Gauge=factory("gauge", gauge_refuses), Histogram=factory("histogram"),
                           Counter=factory("counter"))


def test_prometheus_export_with_a_fake_client():
    made = {}
    exp = export.PrometheusExporter(prom=_fake_prom(made))
    assert made["sglang_h20:stage_ms"].kw["multiprocess_mode"] == "mostrecent"
    rec = synth.synthesize(ranks=2, layers=4, steps=1, seed=0, experts=8, first_dense=1)
    for r in rec:
        exp.observe(r)
    sm = made["sglang_h20:stage_ms"].values
    r0 = next(r for r in rec if r["kind"] == "stages" and r["rank"] == 1)
    assert sm[(("layer", "2"), ("rank", "1"), ("stage", "attention"))] == r0["layers"][2]["stages"]["attention"]
    assert made["sglang_h20:step_ms"].values[(("kind", "graph"), ("rank", "1"))] > 0
    assert len(made["sglang_h20:expert_balancedness"].values) == 2 * 3  # ranks x MoE layers
    exp.observe({**r0, "graph_sampled": True, "remote_share": [0.25, 0.5, 0.75], "step_ms": 9.0})
    assert made["sglang_h20:expert_remote_share"].values[(("layer", str(r0["expert_load_layers"][1])),
                                                          ("rank", "1"))] == 0.5
    assert made["sglang_h20:step_ms"].values[(("kind", "graph_sampled"), ("rank", "1"))] == 9.0
    exp.observe({**r0, "layers": [{"layer": 3, "stages": {}, "overlap": {"shared_expert": 0.5}}]})
    assert sm[(("layer", "3"), ("rank", "1"), ("stage", "overlap:shared_expert"))] == 0.5  # hidden time, its own series


@pytest.mark.parametrize("error", [TypeError("__init__() got an unexpected keyword argument 'multiprocess_mode'"),
                                   ValueError("Invalid multiprocess mode: mostrecent")])
def test_gauges_fall_back_to_mode_all_on_an_old_client_and_other_errors_propagate(error):
    """prometheus_client < 0.17 refuses "mostrecent" (older ones any multiprocess_mode): the gauges are made with
    "all"; an error that is not about the mode is the caller's."""
    made = {}
    export.PrometheusExporter(prom=_fake_prom(made, error))
    assert made["sglang_h20:step_ms"].kw["multiprocess_mode"] == "all"
    assert made["sglang_h20:expert_balancedness"].kw["multiprocess_mode"] == "all"
    with pytest.raises(ValueError, match="Duplicated"):
        export.PrometheusExporter(prom=_fake_prom({}, ValueError("Duplicated timeseries in CollectorRegistry")))


def test_every_exporter_of_a_process_shares_one_prometheus_registration(tmp_path, monkeypatch):
    """The default registry takes each series name once: with --enable-metrics the first exporter of the process
    registers the sglang_h20:* series, later ones reuse them; without it none is made."""
    made = []
    monkeypatch.setattr(export, "PrometheusExporter", lambda: made.append(object()) or made[-1])
    monkeypatch.setattr(export, "_PROCESS_PROM", None)
    monkeypatch.setattr(export, "metrics_enabled", lambda: False)
    assert export.Exporter.for_process(str(tmp_path), 0).prom is None and made == []
    monkeypatch.setattr(export, "metrics_enabled", lambda: True)
    first, second = (export.Exporter.for_process(str(tmp_path), r) for r in (0, 1))
    assert len(made) == 1 and first.prom is second.prom is made[0]
    assert first.writer.path == tmp_path / "observe-rank000.jsonl" and second.writer.path.parent == tmp_path
    monkeypatch.chdir(tmp_path)  # no directory named: the default one, under the server's working directory
    assert export.Exporter.for_process(None, 3).writer.path == Path(export.DEFAULT_DIR, "observe-rank003.jsonl")


def test_prometheus_export_with_the_real_client():
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    exp = export.PrometheusExporter(registry=registry)
    for r in synth.synthesize(ranks=2, layers=3, steps=1, seed=0, experts=8, first_dense=1):
        exp.observe(r)
    text = prometheus_client.generate_latest(registry).decode()
    assert 'sglang_h20:stage_ms{layer="1",rank="0",stage="attention"}' in text
    assert "sglang_h20:step_stage_ms_bucket" in text and "sglang_h20:observe_samples_total" in text


def test_exporter_writes_and_never_raises(tmp_path):
    class Broken:
        def observe(self, r):
            raise RuntimeError("boom")

    e = export.Exporter(export.JsonlWriter(tmp_path, 0), Broken())
    e.emit({"kind": "graph", "rank": 0, "step": 1, "step_ms": 1.0})
    e.emit({"kind": "graph", "rank": 0, "step": 2, "step_ms": 1.0})
    assert e.prom is None and len(export.read_dump(tmp_path)) == 2


# ----------------------------------------------------------------------------- detector
def _detect(inject, seed, **kw):
    recs = synth.synthesize(ranks=kw.pop("ranks", 8), layers=kw.pop("layers", 61), steps=kw.pop("steps", 40),
                            inject=inject, seed=seed, **kw)
    return analyze.detect(recs)


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4])
def test_detector_is_quiet_on_clean_data(seed):
    found = _detect("", seed)
    assert found == [], [a.message for a in found]


def test_detector_is_quiet_on_clean_multi_node_data():
    found = _detect("", 7, ranks=16, steps=30)  # 2 nodes: inter-node links are not "slow links"
    assert found == [], [a.message for a in found]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_detector_finds_a_slow_rank_as_compute(seed):
    found = _detect("slow-rank:3", seed)
    assert found
    assert {a.rank for a in found} == {3}, [a.message for a in found]
    assert {a.kind for a in found} == {"compute"}
    assert {"attention", "routed_experts"} <= {a.stage for a in found}
    att = next(a for a in found if a.stage == "attention")
    assert att.layers == list(range(61)) and att.excess == pytest.approx(0.5, abs=0.05)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_detector_finds_a_slow_dispatch_as_communication(seed):
    found = _detect("slow-stage:dispatch@rank5", seed)
    assert [(a.kind, a.rank, a.stage, a.detector) for a in found] == [("communication", 5, "dispatch", "cross-rank")]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_detector_finds_a_hot_expert_as_imbalance(seed):
    found = _detect("hot-expert:17", seed)
    assert found and {a.kind for a in found} == {"imbalance"}, [a.message for a in found]
    hot = [a for a in found if a.detector == "experts"]
    assert len(hot) == 1 and hot[0].experts == [17] and hot[0].rank == 0  # 256 experts / 8 ranks
    assert any(a.detector == "load" and a.rank == 0 for a in found)
    slow = [a for a in found if a.detector == "cross-rank"]
    assert [(a.rank, a.stage) for a in slow] == [(0, "routed_experts")]  # skewed time, high load


def test_a_hot_expert_alone_on_its_rank_names_that_rank():
    """One expert per rank (8 experts on 8 ranks): expert 5's host is rank 5."""
    found = _detect("hot-expert:5", 0, layers=8, steps=20, experts=8, topk=2, first_dense=1)
    assert [(a.experts, a.rank) for a in found if a.detector == "experts"] == [([5], 5)]


def test_each_loaded_rank_names_its_own_busiest_expert():
    """Expert 5 (rank 0) x10 and expert 40 (rank 1) x20: rank 0's finding names 5, not its neighbour's hotter 40."""
    found = _detect("hot-expert:5x10,hot-expert:40x20", 0)
    load = sorted((a.rank, a.message.rsplit("; ", 1)[-1]) for a in found if a.detector == "load")
    assert load == [(0, "busiest hosted expert 5"), (1, "busiest hosted expert 40")]


def test_detector_separates_combined_faults():
    found = _detect("slow-rank:3,slow-stage:dispatch@rank5,hot-expert:17", 0)
    got = {(a.kind, a.rank) for a in found}
    assert got == {("compute", 3), ("communication", 5), ("imbalance", 0)}, [a.message for a in found]


def test_detector_blames_the_straggler_not_the_waiting_peers():
    found = _detect("spike:attention@rank2:20", 0)
    assert [(a.kind, a.rank, a.stage, a.detector) for a in found] == [("compute", 2, "attention", "over-time")]
    assert found[0].steps == [2100] and "peers 0-1,3-7 waited" in found[0].message


def test_detector_finds_transient_communication_and_slow_links():
    found = _detect("spike:combine@rank4:10,slow-link:1-6", 0)
    assert sorted((a.kind, a.detector, a.rank, a.link) for a in found) == [
        ("communication", "latency", None, (1, 6)), ("communication", "latency", None, (6, 1)),
        ("communication", "over-time", 4, None)]
    found = _detect("slow-link:2-0x5,slow-link:2-1x5,slow-link:2-3x5,slow-link:2-4x5", 1)
    assert [(a.detector, a.rank) for a in found] == [("latency", 2)]  # one slow rank, not 8 links


@pytest.mark.parametrize("inject", ["spike:attention@rank2:20", "spike:combine@rank4:10,slow-link:1-6", "hot-expert:17",
                                    "slow-rank:3"])
def test_every_message_states_the_numbers_of_its_finding(inject):
    """What a person reads (the ratio, the percentage, the link times) is what the anomaly records."""
    found = _detect(inject, 0)
    assert found
    for a in found:
        ratio = a.value / a.baseline
        if a.detector == "experts":
            assert f" gets {ratio:.1f}x the median expert's tokens" in a.message, a.message
        elif a.detector == "latency":
            assert f": {a.value * 1e3:.0f} us vs {a.baseline * 1e3:.0f} us median link" in a.message, a.message
        else:
            assert f"({ratio - 1:+.0%}; " in a.message, a.message
            assert f"{a.value:.3f} ms" in a.message or f"{a.value:.0f} tokens" in a.message, a.message


def test_detector_thresholds_are_configurable():
    recs = synth.synthesize(ranks=8, layers=8, steps=20, inject="slow-rank:3x1.3", seed=0, first_dense=1)
    assert {a.rank for a in analyze.detect(recs)} == {3}
    assert analyze.detect(recs, analyze.Thresholds(rel=0.5)) == []


def _clean_attention(ranks=8):
    """A clean 8-layer dataset whose attention times are set to exactly 1 ms, so a test writes its own deviations."""
    ds = analyze.load(synth.synthesize(ranks=ranks, layers=8, steps=12, seed=5, first_dense=1))
    k = ds.stages.index("attention")
    ds.times[..., k] = 1.0
    return ds, k


def test_cross_rank_counts_isolated_layers_only_when_strong():
    """8 layers: a rank slow at fewer than ceil(0.25 x 8) = 2 layers is reported only where it exceeds twice the
    relative threshold (40%); at 2 layers the plain 20% suffices; with fewer than 4 ranks nothing is compared."""
    def attention_finding(excess_by_layer, ranks=8):  # rank 1 slowed at the given layers
        ds, k = _clean_attention(ranks)
        for layer, excess in excess_by_layer.items():
            ds.times[1, :, ds.layers.index(layer), k] = 1.0 + excess
        return [(a.rank, a.layers) for a in analyze.cross_rank(ds, analyze.Thresholds()) if a.stage == "attention"]

    assert attention_finding({4: 0.3}) == []
    assert attention_finding({4: 0.5}) == [(1, [4])]
    assert attention_finding({4: 0.3, 6: 0.3}) == [(1, [4, 6])]
    assert attention_finding({4: 0.5}, ranks=3) == []  # min_ranks 4


def test_a_slow_rank_with_a_larger_batch_is_imbalance():
    """Slow attention on a rank whose batch is 1.3x the median rank's (> 1 + 0.15) is load, not a slow GPU."""
    ds, k = _clean_attention()
    ds.times[3, ..., k] = 1.5
    ds.tokens[:] = 100.0
    found = [a for a in analyze.cross_rank(ds, analyze.Thresholds()) if a.stage == "attention"]
    assert [(a.kind, a.rank) for a in found] == [("compute", 3)]
    ds.tokens[3] = 130.0
    found = [a for a in analyze.cross_rank(ds, analyze.Thresholds()) if a.stage == "attention"]
    assert [(a.kind, a.rank) for a in found] == [("imbalance", 3)] and "its batch is 1.30x" in found[0].message
    ds.tokens[:] = 1.0  # decode at one sequence per rank: a median of one token is still a baseline
    ds.tokens[3] = 2.0
    found = [a for a in analyze.cross_rank(ds, analyze.Thresholds()) if a.stage == "attention"]
    assert [(a.kind, a.rank) for a in found] == [("imbalance", 3)] and "its batch is 2.00x" in found[0].message


def test_a_rank_with_half_its_links_slow_is_one_finding():
    """8 ranks: 14 links per rank; with 7 of them slow the rank is named once instead of 7 links."""
    ds, _ = _clean_attention()
    ds.latency = np.full((8, 8), 0.02)
    np.fill_diagonal(ds.latency, 0.0)
    for peer in (0, 1, 4):
        ds.latency[2, peer] = ds.latency[peer, 2] = 0.1
    ds.latency[2, 5] = 0.1  # the 7th
    found = analyze.latency_links(ds, analyze.Thresholds())
    assert [(a.rank, a.link) for a in found] == [(2, None)] and "7 of 14 links slow" in found[0].message
    ds.latency[2, 5] = 0.02  # 6 of 14: each link on its own
    assert sorted(a.link for a in analyze.latency_links(ds, analyze.Thresholds())) == sorted(
        [(2, p) for p in (0, 1, 4)] + [(p, 2) for p in (0, 1, 4)])


def test_flags_need_the_absolute_floor_too():
    x = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 1.5])
    for floor, flagged in ((0.4, True), (0.6, False)):  # 0.5 ms above the median
        flag, _, _ = analyze._flags(x, 0, 5.0, 0.2, floor, 0.01)
        assert flag.tolist() == [False] * 5 + [flagged]


def test_robust_z_ignores_outliers_and_floors_the_scale():
    x = np.array([10.0, 10.1, 9.9, 10.0, 50.0])
    z, med, scale = analyze.robust_z(x, 0)
    assert med.item() == 10.0 and z[-1] > 100 and abs(z[:-1]).max() < 2
    z, _, scale = analyze.robust_z(np.full(6, 3.0), 0)  # MAD 0: scale floored at 1% of median
    assert scale.item() == pytest.approx(0.03) and not np.isnan(z).any()


def test_synth_rejects_bad_injections():
    for bad in ("slow-rank:99", "hot-expert:999", "slow-stage:nope@rank1", "what:1", "spike:attention@rank1:500"):
        with pytest.raises(ValueError):
            synth.synthesize(ranks=8, layers=4, steps=5, inject=bad, first_dense=1)
    (inj,) = synth.parse_injections("slow-stage:dispatch@rank5x2.5")
    assert (inj.stage, inj.rank, inj.factor) == ("dispatch", 5, 2.5)
    # the range checks at their edges: 8 ranks, 5 passes, 256 experts (first one past the end refused, the last taken)
    for bad, names in (("slow-rank:8", "rank 8, outside 0..7"), ("slow-link:2-8", "rank 8, outside 0..7"),
                       ("hot-expert:256", "expert 256, outside 0..255"), ("spike:attention@rank1:5", "pass index 5")):
        with pytest.raises(ValueError, match=re.escape(names)):
            synth.synthesize(ranks=8, layers=4, steps=5, inject=bad, first_dense=1)
    for good in ("slow-rank:7", "slow-link:0-7", "hot-expert:255", "hot-expert:0", "spike:attention@rank0:4"):
        assert synth.synthesize(ranks=8, layers=4, steps=5, inject=good, first_dense=1)


# ----------------------------------------------------------------------------- CLI + HTML report
def _cli(*args, timeout=300):
    p = subprocess.run([sys.executable, "-m", "sglang_h20.observe", *args], capture_output=True, text=True,
                       timeout=timeout, cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("observe")
    _cli("synth", "--ranks", "8", "--layers", "61", "--steps", "50",
         "--inject", "slow-rank:3,slow-stage:dispatch@rank5,hot-expert:17", "--out", str(d / "dump.jsonl"))
    out = _cli("report", str(d / "dump.jsonl"), "--out", str(d / "report"))
    assert "report.html" in out
    return d / "report"


def test_report_is_self_contained_with_every_section(report_dir):
    page = (report_dir / "report.html").read_text()
    for sid in report.SECTIONS + report.FIGURES:
        assert f'id="{sid}"' in page, sid
    assert not re.search(r'(src|href)="(?!data:|#)', page), "external resource in the report"
    assert "<link" not in page and "@import" not in page and "url(" not in page
    imgs = re.findall(r'<img [^>]*src="data:image/png;base64,([^"]+)"', page)
    assert len(imgs) == len(report.FIGURES)
    for name in report.FIGURES:
        png = (report_dir / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
    anomalies = json.loads((report_dir / "anomalies.json").read_text())
    assert {(a["kind"], a["rank"]) for a in anomalies} == {("compute", 3), ("communication", 5), ("imbalance", 0)}
    assert "expert 17" in page and "rank 5: dispatch" in page
    # the anomaly table's rank and "stage / expert / link" columns: the stage of a stage finding, the experts of a
    # load finding
    assert re.search(r"<td>5</td><td>dispatch</td>", page) and re.search(r"<td>[0-9]*</td><td>expert 17</td>", page)


def test_anomaly_table_names_the_stage_the_experts_or_the_link():
    """One column says where a finding is: a stage, else the experts, else the link as source->destination."""
    found = [analyze.Anomaly("compute", "cross-rank", "m", rank=5, stage="dispatch"),
             analyze.Anomaly("imbalance", "experts", "m", experts=[17, 40]),
             analyze.Anomaly("communication", "latency", "m", rank=2, link=(2, 6))]
    row = r"<td>([^<]*)</td><td>([^<]*)</td><td>[^<]*</td><td>[^<]*</td><td class"  # rank, where, layers, passes
    cells = re.findall(row, report._anomalies_html(found))
    assert cells == [("5", "dispatch"), ("", "expert 17,40"), ("2", "2-&gt;6")], cells  # the page escapes ">"


def test_cli_exit_codes_defaults_and_warnings(tmp_path, capsys):
    """The exit codes are what scripts read: 0 done, 1 nothing readable, 2 a flagged anomaly with --fail-on-anomaly
    or bad input. synth's defaults are a DeepSeek-V3 EP-8 server's; unreadable lines are named, five at most."""
    from sglang_h20.observe.__main__ import main

    clean, slow = tmp_path / "clean.jsonl", tmp_path / "slow.jsonl"
    assert main(["synth", "--layers", "4", "--first-dense", "1", "--out", str(clean)]) == 0
    assert "(8 ranks x 50 passes, inject: none)" in capsys.readouterr().out
    recs = export.read_dump([clean], [])
    passes = [r for r in recs if r["kind"] == "stages"]  # each sampled pass also has its CUDA-graph reference
    assert {r["rank"] for r in passes} == set(range(8)) and len({r["step"] for r in passes}) == 50
    assert {(r["num_experts"], r["num_tokens"], r["ranks_per_node"]) for r in passes} == {(256, 64, 8)}
    assert main(["synth", "--layers", "4", "--first-dense", "1", "--inject", "slow-rank:3", "--out", str(slow)]) == 0
    capsys.readouterr()
    for dump, flag, code in ((clean, [], 0), (clean, ["--fail-on-anomaly"], 0), (slow, [], 0),
                             (slow, ["--fail-on-anomaly"], 2)):
        assert main(["analyze", str(dump), *flag]) == code, (dump.name, flag)
    capsys.readouterr()

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    for cmd in (["report", str(empty), "--out", str(tmp_path / "r")], ["analyze", str(empty)]):
        assert main(cmd) == 1, cmd
        assert capsys.readouterr().err == f"no records in {empty}\n"

    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("".join(f"not json {i}\n" for i in range(7)) + clean.read_text())
    assert main(["analyze", str(mixed)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 6 and all(e.startswith("warning: skipped ") for e in err[:5]), err
    assert err[5] == "warning: 2 more unreadable lines"

    small = ["synth", "--layers", "4", "--first-dense", "1", "--ranks", "2", "--steps", "2", "--experts", "8",
             "--out", str(tmp_path / "k.jsonl")]
    assert main([*small, "--topk", "8"]) == 0  # as many experts per token as experts is allowed, more is not
    with pytest.raises(SystemExit) as e:
        main([*small, "--topk", "9"])
    assert e.value.code == 2 and "--topk 9 is more than --experts 8" in capsys.readouterr().err


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _render(html_path: Path) -> str:
    exe = _chromium()
    p = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=10000",
                        "--run-all-compositor-stages-before-draw", "--dump-dom", html_path.resolve().as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def _render_check(dom: str) -> dict:
    m = re.search(r'<div id="render-check"([^>]*)>', dom)
    assert m, "render-check element missing"
    return dict(re.findall(r'data-([a-z]+)="([^"]*)"', m.group(1)))


@pytest.mark.skipif(_chromium() is None,
                    reason="no chromium on PATH (install: apt-get install -y chromium)")
def test_report_renders_in_headless_chromium(report_dir, tmp_path):
    dom = _render(report_dir / "report.html")
    for sid in report.SECTIONS + report.FIGURES:
        assert f'id="{sid}"' in dom, sid
    check = _render_check(dom)
    assert check.get("total") == str(len(report.FIGURES)), check  # the on-load script ran
    assert check["ok"] == check["total"] and check["errors"] == "0" and check["bad"] == "", check
    # the check can fail: one corrupted image is reported
    page = (report_dir / "report.html").read_text()
    broken = tmp_path / "broken.html"
    broken.write_text(page.replace("data:image/png;base64,iVBOR", "data:image/png;base64,AAAA", 1))
    check = _render_check(_render(broken))
    assert int(check["ok"]) == len(report.FIGURES) - 1 and check["bad"], check


def test_report_without_load_or_latency_keeps_every_section(tmp_path):
    recs = synth.synthesize(ranks=4, layers=5, steps=10, seed=3, experts=16, first_dense=1, graph_refs=False)
    for r in recs:  # what a dump without routing capture and without a latency probe looks like
        for k in ("expert_load", "expert_load_layers", "balancedness", "peer_latency_ms"):
            r.pop(k, None)
    page = report.build(recs, tmp_path).read_text()
    for sid in report.SECTIONS + report.FIGURES:
        assert f'id="{sid}"' in page, sid
    assert "No rank x rank latency matrix" in page and "No expert load" in page
    assert len(re.findall(r"<img ", page)) == 4


def test_heatmaps_draw_the_datasets_numbers(monkeypatch):
    """Each heatmap's cells are the dataset's figures in the unit its label names (ms -> us), the rank x stage one
    is centred on 1 with a symmetric colour range, and the expert-load lines sit on the EP rank boundaries."""
    monkeypatch.setattr(report, "_png", lambda fig: fig)  # the figure itself instead of its PNG
    ds = analyze.load(synth.synthesize(ranks=4, layers=5, steps=6, seed=2, first_dense=1, experts=16))
    cells = lambda fig: fig.axes[0].images[0].get_array()  # noqa: E731
    layer_stage = analyze.nanmedian(analyze.nanmedian(ds.times, axis=1), axis=0) * 1e3
    assert np.allclose(cells(report.plot_layer_stage(ds)).filled(np.nan), layer_stage, equal_nan=True)
    lat = cells(report.plot_latency(ds))
    off = ~np.eye(4, dtype=bool)
    assert lat.mask[~off].all() and np.allclose(lat.data[off], ds.latency[off] * 1e3)
    fig = report.plot_rank_stage(ds)
    tot = np.nansum(analyze.nanmedian(ds.times, axis=1), axis=1)
    ratio = cells(fig)
    assert np.allclose(ratio, tot / analyze.nanmedian(tot, axis=0))
    lo, hi = fig.axes[0].images[0].get_clim()
    assert lo + hi == pytest.approx(2.0) and hi - 1 >= max(0.25, float(np.abs(ratio - 1).max())) - 1e-12
    lines = [ln.get_xdata()[0] for ln in report.plot_expert_load(ds).axes[0].lines]
    assert (ds.experts_per_rank, ds.ep_size) == (4, 4) and lines == [3.5, 7.5, 11.5]
    report._plt().close("all")


def test_expert_mean_is_tokens_per_expert_per_pass_over_all_ranks():
    """Each pass's loads are summed over the ranks and averaged over the passes: rank r routes r + 1 + i tokens to
    every expert of load layer i in every pass, so two ranks give 3, 5 and 7 per expert."""
    recs = synth.synthesize(ranks=2, layers=4, steps=5, seed=1, experts=16, first_dense=1, graph_refs=False)
    for r in recs:
        r["expert_load"] = [[float(r["rank"] + 1 + i)] * 16 for i in range(len(r["expert_load"]))]
    ds = analyze.load(recs)
    assert np.array_equal(ds.expert_mean, np.repeat([[3.0], [5.0], [7.0]], 16, axis=1))


def test_a_stage_no_other_rank_spends_time_in_is_named_without_a_ratio():
    """A median rank at 0 ms has no ratio to print: the finding gives the rank's own time."""
    recs = synth.synthesize(ranks=8, layers=4, steps=10, seed=1, experts=16, first_dense=1, graph_refs=False)
    for r in recs:
        for e in r["layers"]:
            if "router" in e["stages"]:
                e["stages"]["router"] = 0.05 if r["rank"] == 3 else 0.0
    found = [a for a in analyze.detect(analyze.load(recs), analyze.Thresholds()) if a.stage == "router"]
    want = [(3, 0.0, "rank 3: router 0.150 ms per pass (layers 1-3)")]
    assert [(a.rank, a.baseline, a.message) for a in found] == want


def test_full_latency_matrix_records_are_read():
    recs = synth.synthesize(ranks=8, layers=4, steps=10, seed=2, experts=16, first_dense=1, graph_refs=False)
    m = np.full((8, 8), 0.02)
    np.fill_diagonal(m, 0)
    m[3, 4] = 0.2
    for r in recs:
        r.pop("peer_latency_ms")
    recs[0]["rank_latency_ms"] = m.tolist()
    found = analyze.latency_links(analyze.load(recs), analyze.Thresholds())
    assert [(a.kind, a.link) for a in found] == [("communication", (3, 4))]


def test_links_within_a_node_and_across_nodes_have_their_own_baselines():
    """Eight ranks, four per node (`ranks_per_node` from the records): cross-node links at 3x the intra-node time
    are normal, and one intra-node link at that time is flagged."""
    recs = synth.synthesize(ranks=8, layers=4, steps=10, seed=2, experts=16, first_dense=1, graph_refs=False)
    node = np.arange(8) // 4
    m = np.where(node[:, None] == node[None, :], 0.02, 0.06)
    np.fill_diagonal(m, 0)
    m[1, 2] = 0.06
    for r in recs:
        r.pop("peer_latency_ms")
        r["ranks_per_node"] = 4
    recs[0]["rank_latency_ms"] = m.tolist()
    ds = analyze.load(recs)
    assert ds.ranks_per_node == 4
    assert [(a.kind, a.link) for a in analyze.latency_links(ds, analyze.Thresholds())] == [("communication", (1, 2))]


def test_over_time_charges_the_waiting_peers_step_to_the_straggler_but_keeps_its_own():
    """At the pass where rank 2's attention spikes, the other ranks wait in dispatch and every rank's step grows:
    the peers' dispatch and step flags are waits and dropped; rank 2 keeps its attention and its step."""
    rng = np.random.default_rng(0)
    recs = []
    for s in range(12):
        for r in range(8):
            att, dis = 1.0 + 0.01 * rng.standard_normal(), 0.3 + 0.003 * rng.standard_normal()
            if s == 9:
                att, dis = (att + 2.0, dis) if r == 2 else (att, dis + 2.0)
            step = att + dis + 0.5 + 0.005 * rng.standard_normal()
            recs.append({"kind": "stages", "rank": r, "step": 100 + s, "step_ms": step,
                         "layers": [{"layer": 0, "stages": {"attention": att, "dispatch": dis}}]})
    found = analyze.over_time(analyze.load(recs), analyze.Thresholds())
    assert [(a.kind, a.rank, a.stage, a.steps) for a in found] == [("compute", 2, "attention", [109]),
                                                                     ("compute", 2, "step", [109])]
    assert all("peers 0-1,3-7 waited" in a.message for a in found)


@pytest.mark.parametrize("frac, flagged", [(0.25, True), (0.5, False)])
def test_load_imbalance_needs_its_share_of_moe_layers(frac, flagged):
    """Rank 5's experts get 1.5x the tokens in one of four MoE layers: a finding at a 25% layer share (one layer
    suffices), none at 50%."""
    rng = np.random.default_rng(0)
    recs = []
    for s in range(12):
        for r in range(8):
            load = rng.poisson(100, (4, 64)).astype(float)
            load[1, 40:48] *= 1.5
            recs.append({"kind": "stages", "rank": r, "step": s, "step_ms": 1.0,
                         "layers": [{"layer": 0, "stages": {"attention": 1.0}}], "num_experts": 64,
                         "experts_per_rank": 8, "ep_size": 8, "expert_load_layers": [3, 4, 5, 6],
                         "expert_load": load.tolist()})
    found = analyze.load_imbalance(analyze.load(recs), analyze.Thresholds(load_layer_frac=frac))
    assert [(a.rank, a.layers) for a in found] == ([(5, [4])] if flagged else [])
    if flagged:
        assert found[0].value / found[0].baseline == pytest.approx(1.5, abs=0.05)
        assert "busiest hosted expert 4" in found[0].message


def test_a_zero_baseline_claims_no_ratio():
    """Nothing to compare with: an anomaly whose baseline is 0 has no excess (its JSON says null, not a division by
    zero), and a rank's received load over a median rank that received nothing is unknown (NaN), not infinite, so the
    cross-rank detector does not call it an imbalance of 'infx'."""
    a = analyze.Anomaly("compute", "cross-rank", "x", value=2.0, baseline=0.0)
    assert a.excess == float("inf") and a.to_json()["excess"] is None
    assert analyze.Anomaly("compute", "cross-rank", "x", value=3.0, baseline=2.0).to_json()["excess"] == 0.5
    recv = np.zeros((4, 2, 3))  # [steps, layers, ranks]: layer 0 only rank 2 receives; layer 1 all alike
    recv[:, 0, 2] = 64.0
    recv[:, 1, :] = 10.0
    recv[:, 1, 1] = 30.0
    ratio = analyze._rank_recv_ratio(SimpleNamespace(recv=recv))
    assert np.isnan(ratio[0]).all()
    np.testing.assert_allclose(ratio[1], [1.0, 3.0, 1.0])
