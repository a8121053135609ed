"""Sampled per-stage timing of the DeepSeek decode step, per layer and per rank, with CUDA graphs on.

Sampling design (why CUDA graphs stay on)
-----------------------------------------
A replayed CUDA graph runs no Python, so per-layer hooks cannot time it, and timing inside the
graph (event nodes or timer kernels) would cost every replay whether sampled or not. So the
unsampled steps replay the plain graphs, and a *sampled* step replays an instrumented twin:

* Instrumented graphs (`DecodeCudaGraphRunner.capture_one_shape`, AROUND): after SGLang captures a
  batch size, the same shape is captured again as graph variant "h20_observe" with the stage hooks
  active, and every push/pop records an external timing event (`torch.cuda.Event(enable_timing=True,
  external=True)`: an event-record node that each replay re-records). The frames of that capture are
  the size's template. A sampled pass asks for the variant (`_make_graph_key`, AROUND), and reads the
  template's events once they complete: per-layer, per-stage times of a real graph replay, for the cost
  of ~1000 event nodes on that one step instead of an eager step (r ~ 9 on the H200). A template is not
  replayed again until its last sample was read. If the instrumented capture fails, one warning, and
  sampling falls back to the eager path below. Graph samples carry `window_ms`, the pass timed around
  the replay from outside (its input copies included), which the stage sum is checked against.

Eager fallback (no instrumented graph: `--disable-cuda-graph`, or its capture failed): the sampled
decode step runs eagerly:

* `ModelRunner.forward` (AROUND) is the step window. `ModelRunner.forward_pass_id + 1` is the
  id of the pass about to run. Pass p gets stage timing when `p % period == 0`, with
  `period = round(1 / SGLANG_H20_OBSERVE)` (0.01 -> every 100th pass). The rule is deterministic
  and uses the same counter on every rank, and all ranks run their passes in lockstep (DP
  attention runs IDLE passes). So every rank of a TP/EP group runs the same pass eagerly.
  A rank that alone ran eagerly would all-reduce an unpadded tensor while its peers replay a
  padded one, which hangs NCCL. This is why we use no random sampling and no per-rank decision.
  Only decode-family passes are sampled (DECODE, IDLE, TARGET_VERIFY). Prefill already runs
  eagerly, and it is not the subject. Draft-model (MTP) runners are never sampled.
* `DecodeCudaGraphRunner.can_run_graph` (AROUND) answers False during a sampled pass, so
  `_forward_raw` takes its own eager path (`_prepare_eager_forward_batch` + eager runner), the
  same path SGLang uses for batches above `--cuda-graph-max-bs`. The graphs stay captured and
  are used for every other pass. We remember what it would have answered (`graph_would_run`).
* Pass p with `p % period == period // 2` (period >= 2) gets a graph reference: two CUDA events
  around the unchanged graph replay, emitted as a `kind: "graph"` record. Comparing it with the
  sampled eager steps' `step_ms` measures how much eager execution inflates the step.
* Completed samples are read without a device sync: at the start of each later pass we
  `query()` the sample's last event and only then read elapsed times and the load counts
  (copied non-blocking into pinned memory before that event; a twin replay's counts right after
  the replay, since the plain graphs share its memory pool and their replays may overwrite them).

Runtime control (SGLANG_H20_OBSERVE_CONTROL=<file>): the file holds a fraction that replaces
SGLANG_H20_OBSERVE while serving, so one server can alternate observation on and off
(benchmark/serving/observe_overhead.py measures the overhead that way). It is checked only on
passes p with `p % CONTROL_EVERY == 0` (one os.stat; read when mtime or size changed), and on
a TP group of several ranks rank 0 reads it and broadcasts the value over the group's CPU
channel, so every rank switches at the same pass and the sampling rule stays identical. At
fraction 0 the hooks pass every call straight through: graphs replay as upstream. The hooks
are installed only when SGLANG_H20_OBSERVE > 0 at start.

Cost: with instrumented twins, a sampled step is a graph replay plus its ~1000 event nodes (61 layers
x 8 frames x 2) and 58 small load-count scatters; unsampled steps replay the plain graphs and pay
nothing; capture time and graph memory double (one twin per captured batch size). Measured on the H200
(dsv3-ep16-slice, 48 running, f = 0.01, 2026-11-29): a twin replay took 1.16x a plain one (25.9 vs 22.2 ms),
so f*(r-1) = 0.16%; output tok/s on/off 0.9992 (benchmark/results/observe/observe_overhead_twins_h200.json).
In the eager fallback a fraction f of decode steps runs eagerly, slower by the
eager/graph ratio r: measured on the H200 (dsv3-ep16-slice, 48 running): r = 8.7-9.9 (207-209 ms
eager vs 21-22 ms graph); f = 0.01 cost 14% of throughput, f = 0.001 1.5-2.2% (not conclusive).
Eager non-sampled passes (prefill) pay one global read per hooked call (~0.3 us x ~600 calls).
benchmark/serving/observe_overhead.py measures it on one server (runtime control above).

Hook targets (sglang 0.5.17, all checked by test_observe against the installed sglang)
-------------------------------------------------------------------------------------
step      model_runner.ModelRunner.forward                 AROUND: sample decision, window, drain
eager     decode_cuda_graph_runner.DecodeCudaGraphRunner.can_run_graph  AROUND: False when sampled eagerly
twin      DecodeCudaGraphRunner.capture_one_shape           AROUND: capture the instrumented twin
          DecodeCudaGraphRunner._make_graph_key             AROUND: the twin's key on a sampled pass
layer     deepseek_v2.DeepseekV2DecoderLayer.forward       frame "layer_other" (norms, residual,
          LayerCommunicator collectives, prefetch: whatever no inner stage covers)
attention deepseek_v2.DeepseekV2AttentionMLA.forward       "attention" (projections, RoPE, core, o_proj)
moe       deepseek_v2.DeepseekV2MoE.forward                frame "moe_other" (scale/add, TP all-reduce)
router    deepseek_v2.MoEGate.forward + moe.topk.TopK.forward  "router". TopK's output also gives
          the top-k *physical* ids (after the EPLB logical->physical remap, padded rows -1)
          that the per-rank expert load comes from.
shared    deepseek_v2.DeepseekV2MoE._forward_shared_experts  "shared_expert". On the DeepEP path
          SGLang issues it on `alt_stream`, so it overlaps dispatch. It is then reported under
          `overlap`, not in the critical-path stages. Inside SBO's dispatch hook it runs on the
          main stream, nested in dispatch, and is subtracted from dispatch.
experts   FusedMoE.forward_impl and DeepEPMoE.forward_impl  frame labelled "dispatch" until the
          routed GEMMs start, "combine" after them. It includes token quantisation/permutation
          (standard) or the DeepEP dispatch/combine kernels (a2a).
routed    FusedMoE.run_moe_core and DeepEPMoE.run_moe_core  "routed_experts" (the grouped GEMMs).
          DeepEPMoE subclasses override both. With `deprecate_flag` they call super(), so
          nested calls of the same frame kind are not timed twice.
dense     deepseek_v2.DeepseekV2MLP.forward                "dense_mlp" (first_k_dense layers only;
          the shared expert is also a DeepseekV2MLP and is skipped inside an MoE frame)
Hooking the dispatcher classes directly would need one target per a2a backend (standard,
DeepEP normal/LL, mooncake, mori, ...). Bracketing `run_moe_core` inside `forward_impl` covers
them all with four targets.

Attribution
-----------
Frames form a stack. Every push and pop on the step's main stream records one event, and each
segment between two consecutive events is charged to the frame on top at its start, under
that frame's current label. So the stages of each layer are *exclusive* times, and per-layer
stages plus `outside` ("outside_layers": embedding, final norm, logits, attention-backend
metadata) add up to `step_ms` exactly. A frame opened on another stream (shared experts on
`alt_stream`) is timed start-to-end on that stream and reported under `overlap`. SBO overlap
windows can be added the same way later. Not covered: two-batch overlap (TBO) runs the
layers through op_* lists instead of DecoderLayer.forward, so its stages fall into
`outside`, and a record's `coverage` shows that. mega_moe and flashinfer dual-stream graph
paths have no per-stage split.

Caveat: eager stage times include the GPU idling while the CPU launches kernels. They can
differ from graph replay, which also overlaps the shared experts in forward_normal (dual-stream
only in capture). Compare `step_ms` with the graph reference records.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from typing import Any

from sglang_h20.controlfile import ControlFile
from sglang_h20.features import Hook

log = logging.getLogger("sglang_h20.observe")

# ----------------------------------------------------------------------------- vocabulary
STAGES = ("attention", "router", "dispatch", "routed_experts", "combine", "shared_expert",
          "dense_mlp", "moe_other", "layer_other")
OUTSIDE = "outside_layers"  # step time outside every layer frame
COMMUNICATION_STAGES = ("dispatch", "combine")
EXPERT_STAGES = ("routed_experts",)
COMPUTE_STAGES = tuple(s for s in STAGES if s not in COMMUNICATION_STAGES + EXPERT_STAGES)
DECODE_MODES = ("decode", "idle", "target_verify")

DS = "sglang.srt.models.deepseek_v2"
FUSED_MOE = "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE"
DEEPEP_MOE = "sglang.srt.layers.moe.ep_moe.layer.DeepEPMoE"
STEP_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
DECODE_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
GRAPH_TARGET = DECODE_RUNNER + ".can_run_graph"
CAPTURE_TARGET = DECODE_RUNNER + ".capture_one_shape"
KEY_TARGET = DECODE_RUNNER + "._make_graph_key"
GRAPH_VARIANT = "h20_observe"  # the instrumented twin of each captured decode batch size
TWIN_BACKENDS = ("FullCudaGraphBackend",)  # one whole graph per shape: every mark is a graph node
LAYER_TARGET = DS + ".DeepseekV2DecoderLayer.forward"
ATTENTION_TARGET = DS + ".DeepseekV2AttentionMLA.forward"
MOE_TARGET = DS + ".DeepseekV2MoE.forward"
SHARED_TARGET = DS + ".DeepseekV2MoE._forward_shared_experts"
GATE_TARGET = DS + ".MoEGate.forward"
DENSE_TARGET = DS + ".DeepseekV2MLP.forward"
TOPK_TARGET = "sglang.srt.layers.moe.topk.TopK.forward"
EXPERTS_TARGETS = (FUSED_MOE + ".forward_impl", DEEPEP_MOE + ".forward_impl")
ROUTED_TARGETS = (FUSED_MOE + ".run_moe_core", DEEPEP_MOE + ".run_moe_core")
MAX_PENDING = 4  # samples waiting for their events; a new sample is skipped beyond this
CONTROL_EVERY = 32  # passes between checks of the control file


# ----------------------------------------------------------------------------- clocks
class CpuClock:
    """time.perf_counter marks: the recorder's bookkeeping, testable without a GPU."""

    name = "cpu"

    def mark(self) -> float:
        return time.perf_counter()

    def ready(self, mark) -> bool:
        return True

    def elapsed_ms(self, a, b) -> float:
        return (b - a) * 1e3

    def stream(self):
        return None  # one stream

    def release(self, marks) -> None:
        pass


class CudaClock:
    """CUDA events (enable_timing) recorded on the current stream, recycled through a pool."""

    name = "cuda"

    def __init__(self):
        import torch

        self._torch = torch
        self._pool: list = []

    def mark(self):
        ev = self._pool.pop() if self._pool else self._torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def ready(self, mark) -> bool:
        return mark.query()

    def elapsed_ms(self, a, b) -> float:
        return a.elapsed_time(b)

    def stream(self):
        return self._torch.cuda.current_stream()

    def release(self, marks) -> None:
        self._pool.extend(marks)


class GraphClock(CudaClock):
    """External timing events, one per mark: captured as event-record nodes, so every replay of the
    graph re-records them. They belong to their graph's template and are never pooled."""

    name = "cuda_graph"

    def mark(self):
        ev = self._torch.cuda.Event(enable_timing=True, external=True)
        ev.record()
        return ev

    def release(self, marks) -> None:
        pass


def default_clock():
    try:
        import torch

        if torch.cuda.is_available():
            return CudaClock()
    except Exception:
        pass
    return CpuClock()


# ----------------------------------------------------------------------------- recorder
class Frame:
    __slots__ = ("kind", "label", "layer", "main", "start", "then", "then_parent")

    def __init__(self, kind, label, layer, main, start=None, then=None, then_parent=None):
        self.kind, self.label, self.layer, self.main = kind, label, layer, main
        self.start, self.then, self.then_parent = start, then, then_parent


@dataclasses.dataclass
class _Sample:
    step: int
    meta: dict
    timeline: list  # (mark, layer, label); the last entry's label is None (end of step)
    overlap: list  # (start, end, layer, label) of frames on another stream
    loads: dict  # layer -> device counts [P]
    load_meta: dict
    host_loads: Any  # pinned host copy (filled asynchronously) or None
    load_layers: list
    ts: float
    cpu_ms: float
    window: tuple | None = None  # (start, end) marks around the pass, from outside the graph
    template: Any = None  # the _Template whose events these are (graph samples: never released)


@dataclasses.dataclass
class _Template:
    """An instrumented graph's frames: one _Sample whose marks every replay re-records."""

    sample: _Sample
    in_flight: bool = False  # a sample of it is queued and not read yet: do not replay it


@dataclasses.dataclass
class _Window:
    step: int
    meta: dict
    start: Any
    end: Any = None
    ts: float = 0.0


class StageRecorder:
    """Stack-of-frames stage timer for one step at a time (see the module docstring).

    Use: begin_step(step) ... push()/pop() (or `with stage(...)`) ... end_step(); later poll()
    returns finished records (dicts in the export schema), oldest first.
    """

    def __init__(self, clock=None, rank: int = 0, max_pending: int = MAX_PENDING):
        self.clock = clock if clock is not None else default_clock()
        self.rank = rank
        self.max_pending = max_pending
        self.active = False
        self.moe_meta: dict | None = None  # experts geometry of the MoE layer being run
        self._stack: list[Frame] = []
        self._timeline: list = []
        self._overlap: list = []
        self._loads: dict = {}
        self._load_meta: dict = {}
        self._main = None
        self._step = -1
        self._meta: dict = {}
        self._ts = 0.0
        self._cpu0 = 0.0
        self._pending: deque = deque()  # _Sample or _Window, in issue order
        self._captured: _Template | None = None  # the last end_step(template=True)

    # -------------------------------------------------------------- step window
    def can_sample(self) -> bool:
        return not self.active and len(self._pending) < self.max_pending

    def begin_step(self, step: int, meta: dict | None = None) -> None:
        if self.active:
            raise RuntimeError("begin_step inside an open step")
        self._main = self.clock.stream()
        self._step, self._meta = int(step), dict(meta or {})
        self._ts, self._cpu0 = time.time(), time.perf_counter()
        self._stack = [Frame("step", OUTSIDE, None, True)]
        self._timeline = [(self.clock.mark(), None, OUTSIDE)]
        self._overlap, self._loads, self._load_meta = [], {}, {}
        self.moe_meta = None
        self.active = True

    def end_step(self, discard: bool = False, template: bool = False, **meta) -> None:
        """Close the step. Unless discarded it is queued until its events complete (poll).
        template: a graph capture; the step becomes `take_template()`'s, and its load counts stay on the
        device (no host copy inside a capture)."""
        if not self.active:
            return
        self.active = False
        host, layers = None, sorted(self._loads)
        if not discard and layers and not template:
            host = _copy_loads(self._loads, layers)
        end = self.clock.mark()  # after the load copy: ready(end) implies the copy landed
        timeline = self._timeline + [(end, None, None)]
        if discard:
            self.clock.release([m for m, _, _ in timeline] + [m for o in self._overlap for m in o[:2]])
        else:
            self._meta.update(meta)
            sample = _Sample(self._step, self._meta, timeline, self._overlap, self._loads, self._load_meta, host,
                             layers, self._ts, (time.perf_counter() - self._cpu0) * 1e3)
            if template:
                self._captured = _Template(sample)
            else:
                self._pending.append(sample)
        self._stack, self._timeline, self._overlap, self._loads = [], [], [], {}

    def take_template(self) -> _Template | None:
        """The step a capture just closed, as a graph template (None if the capture recorded none)."""
        tmpl, self._captured = self._captured, None
        return tmpl

    def queue_graph_sample(self, tmpl: _Template, step: int, meta: dict, start) -> None:
        """A replay of `tmpl`'s graph ran for pass `step` (from mark `start`): read its events once they complete.

        Its load counts are copied to the host now, stream-ordered right after the replay: they live in the graph
        pool, where the plain graph captured before the twin may have left temporaries that its next replay
        overwrites. The window's end mark follows the copy, so ready(end) implies it landed."""
        t = tmpl.sample
        tmpl.in_flight = True
        host = _copy_loads(t.loads, t.load_layers) if t.loads else None
        window = (start, self.clock.mark())
        self._pending.append(dataclasses.replace(t, step=int(step), meta={**t.meta, **meta}, ts=time.time(),
                                                 cpu_ms=0.0, window=window, template=tmpl, host_loads=host))

    def begin_window(self, step: int, meta: dict | None = None) -> _Window:
        """Whole-step timing without stages (the graph-replay reference)."""
        return _Window(int(step), dict(meta or {}), self.clock.mark(), ts=time.time())

    def end_window(self, window: _Window, keep: bool = True, **meta) -> None:
        window.end = self.clock.mark()
        if keep:
            window.meta.update(meta)
            self._pending.append(window)
        else:
            self.clock.release([window.start, window.end])

    # -------------------------------------------------------------- frames
    def push(self, kind: str, label: str, layer: int | None = None,
             then: str | None = None, then_parent: str | None = None) -> Frame | None:
        """Open a frame. `then`: the label the parent takes when this frame closes, if the
        parent's kind is `then_parent` (routed experts turn an experts frame from dispatch to combine)."""
        if not self.active:
            return None
        parent = self._stack[-1]
        if not parent.main:
            return None  # nested inside an off-stream frame: covered by it
        if layer is None:
            layer = parent.layer
        main = self.clock.stream() == self._main
        f = Frame(kind, label, layer, main, then=then, then_parent=then_parent)
        if main:
            self._timeline.append((self.clock.mark(), layer, label))
        else:
            f.start = self.clock.mark()
        self._stack.append(f)
        return f

    def pop(self, frame: Frame | None) -> None:
        if frame is None or not self.active or frame not in self._stack:
            return
        while self._stack[-1] is not frame:  # an exception skipped inner pops
            self._stack.pop()
        self._stack.pop()
        parent = self._stack[-1]
        if frame.then is not None and parent.kind == frame.then_parent:
            parent.label = frame.then
        if frame.main:
            self._timeline.append((self.clock.mark(), parent.layer, parent.label))
        else:
            self._overlap.append((frame.start, self.clock.mark(), frame.layer, frame.label))

    def stage(self, kind: str, label: str | None = None, **kw):
        return _StageCtx(self, kind, label or kind, kw)

    def top_kind(self) -> str | None:
        return self._stack[-1].kind if self._stack else None

    def inside(self, kind: str) -> bool:
        return any(f.kind == kind for f in self._stack)

    # -------------------------------------------------------------- expert load
    def record_load(self, layer: int, topk_ids, num_experts: int, experts_per_rank: int = 0,
                    ep_size: int = 1) -> None:
        """Count this rank's top-k choices per (physical) expert of `layer`, on the device, no sync.

        Ids outside [0, num_experts) (padding -1) are dropped.
        """
        if not self.active or topk_ids is None or layer is None or num_experts <= 0:
            return
        import torch

        ids = topk_ids.reshape(-1).to(torch.int64)
        idx = torch.where((ids >= 0) & (ids < num_experts), ids, torch.full_like(ids, num_experts))
        counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=ids.device)
        counts.scatter_add_(0, idx, torch.ones_like(idx, dtype=torch.int32))
        counts = counts[:num_experts]
        per_token = ep_size > 1 and experts_per_rank > 0 and 0 <= self.rank < ep_size
        if per_token:  # carried after the expert counts, split off at read-out
            counts = torch.cat([counts, self._token_counts(topk_ids, num_experts, experts_per_rank, ep_size)])
        prev = self._loads.get(layer)
        self._loads[layer] = counts if prev is None else prev + counts
        self._load_meta = {"num_experts": int(num_experts), "experts_per_rank": int(experts_per_rank),
                           "ep_size": int(ep_size), "token_counts": per_token}

    def _token_counts(self, topk_ids, num_experts: int, experts_per_rank: int, ep_size: int):
        """int32 [tokens routed, tokens with an expert on another rank, other ranks they are sent to] of this
        rank's tokens, on the device: a token leaves its GPU once per other GPU holding one of its experts (a
        dispatch copy), which placement can lower; the share of (token, expert) pairs on other GPUs it cannot,
        for its DP rank does not depend on its experts. Where the MoE routes the tokens of every DP rank gathered
        (no all-to-all backend), each rank counts them all as its own: the mean over ranks is then the share for a
        token whose rank does not depend on its experts."""
        import torch

        ids = topk_ids.reshape(-1, topk_ids.shape[-1]).to(torch.int64)
        valid = (ids >= 0) & (ids < num_experts)
        owner = torch.clamp(torch.div(ids, experts_per_rank, rounding_mode="floor"), 0, ep_size - 1)
        remote = valid & (owner != self.rank)
        dest = torch.zeros(ids.shape[0], ep_size, dtype=torch.int32, device=ids.device)
        dest.scatter_(1, torch.where(remote, owner, torch.full_like(owner, self.rank)), 1)
        dest[:, self.rank] = 0
        return torch.stack([valid.any(dim=1).sum(), remote.any(dim=1).sum(), dest.sum()]).to(torch.int32)

    # -------------------------------------------------------------- read-out
    def pending(self) -> int:
        return len(self._pending)

    def poll(self) -> list[dict]:
        """Records of every queued sample whose events have completed, in order (no sync)."""
        out = []
        while self._pending:
            item = self._pending[0]
            if isinstance(item, _Window):
                if not self.clock.ready(item.end):
                    break
                out.append(self._window_record(item))
            else:
                if not (self.clock.ready(item.timeline[-1][0]) and
                        all(self.clock.ready(o[1]) for o in item.overlap) and
                        (item.window is None or self.clock.ready(item.window[1]))):
                    break
                out.append(self._sample_record(item))
            self._pending.popleft()
        return out

    def _window_record(self, w: _Window) -> dict:
        ms = self.clock.elapsed_ms(w.start, w.end)
        self.clock.release([w.start, w.end])
        return {"kind": "graph", "ts": w.ts, "rank": self.rank, "step": w.step, "step_ms": ms, **w.meta}

    def _sample_record(self, s: _Sample) -> dict:
        clock = self.clock
        per_layer: dict[int, dict[str, float]] = {}
        overlap: dict[int, dict[str, float]] = {}
        outside: dict[str, float] = {}
        tl = s.timeline
        for (m0, layer, label), (m1, _, _) in zip(tl, tl[1:]):
            ms = clock.elapsed_ms(m0, m1)
            d = outside if layer is None else per_layer.setdefault(layer, {})
            d[label] = d.get(label, 0.0) + ms
        for start, end, layer, label in s.overlap:
            d = overlap.setdefault(layer if layer is not None else -1, {})
            d[label] = d.get(label, 0.0) + clock.elapsed_ms(start, end)
        step_ms = clock.elapsed_ms(tl[0][0], tl[-1][0])
        if s.template is None:
            clock.release([m for m, _, _ in tl] + [m for o in s.overlap for m in o[:2]])
        host_loads = s.host_loads
        window_ms = None
        if s.window is not None:
            window_ms = clock.elapsed_ms(*s.window)
            clock.release(list(s.window))
        if s.template is not None:
            s.template.in_flight = False
        layers = []
        for layer in sorted(set(per_layer) | {l for l in overlap if l >= 0}):
            entry = {"layer": layer, "stages": per_layer.get(layer, {})}
            if layer in overlap:
                entry["overlap"] = overlap[layer]
            layers.append(entry)
        rec = {"kind": "stages", "ts": s.ts, "rank": self.rank, "step": s.step, "clock": clock.name,
               "step_ms": step_ms, "cpu_ms": s.cpu_ms, "layers": layers, "outside": outside,
               "coverage": (step_ms - outside.get(OUTSIDE, 0.0)) / step_ms if step_ms > 0 else 0.0}
        if -1 in overlap:
            rec["overlap"] = overlap[-1]
        if window_ms is not None:
            rec["window_ms"] = window_ms
        rec.update(s.meta)
        if host_loads is not None:
            loads = host_loads.tolist()
            n = s.load_meta.get("num_experts", 0)
            if s.load_meta.get("token_counts"):  # [tokens, leaving, copies] after each layer's expert counts
                tokens = [row[n:n + 3] for row in loads]
                loads = [row[:n] for row in loads]
                rec["token_leave_share"] = [left / t if t else 0.0 for t, left, _ in tokens]
                rec["remote_copies_per_token"] = [c / t if t else 0.0 for t, _, c in tokens]
            rec["expert_load_layers"] = list(s.load_layers)
            rec["expert_load"] = loads
            rec.update({k: v for k, v in s.load_meta.items() if k != "token_counts"})
            rec["balancedness"] = balancedness(loads, s.load_meta.get("experts_per_rank", 0),
                                               s.load_meta.get("ep_size", 1))
            if s.load_meta.get("ep_size", 1) > 1 and self.rank < s.load_meta["ep_size"]:
                rec["remote_share"] = remote_share(loads, s.load_meta.get("experts_per_rank", 0),
                                                   s.load_meta["ep_size"], self.rank)
        return rec


def _copy_loads(loads: dict, layers):
    """The per-layer device counts of `layers`, stacked into a pinned host tensor by an async copy on the current
    stream (a plain clone off the GPU)."""
    import torch

    dev = torch.stack([loads[l] for l in layers])
    if dev.device.type != "cuda":
        return dev.clone()
    host = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
    host.copy_(dev, non_blocking=True)
    return host


class _StageCtx:
    __slots__ = ("rec", "args", "frame")

    def __init__(self, rec, kind, label, kw):
        self.rec, self.args = rec, (kind, label, kw)

    def __enter__(self):
        kind, label, kw = self.args
        self.frame = self.rec.push(kind, label, **kw)
        return self.frame

    def __exit__(self, *exc):
        self.rec.pop(self.frame)
        return False


def rank_loads(counts, experts_per_rank: int, ep_size: int):
    """Tokens received per EP rank from per-physical-expert counts (expert e lives on rank
    e // experts_per_rank). counts [..., P] -> float array [..., ep_size]."""
    import numpy as np

    c = np.asarray(counts, dtype=float)
    n = c.shape[-1]
    if ep_size <= 1 or n == 0:
        return c.sum(axis=-1, keepdims=True)
    per = experts_per_rank if experts_per_rank > 0 else -(-n // ep_size)
    owner = np.minimum(np.arange(n) // per, ep_size - 1)
    out = np.zeros(c.shape[:-1] + (ep_size,))
    for r in range(ep_size):
        out[..., r] = c[..., owner == r].sum(axis=-1)
    return out


def remote_share(counts, experts_per_rank: int, ep_size: int, rank: int) -> list[float]:
    """Per MoE layer: the share of this rank's routed (token, expert) pairs whose expert lives on another
    EP rank, i.e. the dispatched tokens that leave this GPU (the quantity expert-affinity placement lowers).
    counts [L, P] from this rank's own routing; a layer without routed pairs gives 0."""
    import numpy as np

    loads = np.atleast_2d(rank_loads(counts, experts_per_rank, ep_size))
    total = loads.sum(axis=-1)
    return [float(1 - loads[i, rank] / t) if t > 0 else 0.0 for i, t in enumerate(total)]


def balancedness(counts, experts_per_rank: int, ep_size: int):
    """mean / max of the per-rank load (1.0 = perfectly balanced), SGLang's definition.
    counts [P] -> float; counts [L, P] -> list of floats."""
    import numpy as np

    loads = rank_loads(counts, experts_per_rank, ep_size)
    top = loads.max(axis=-1)
    b = np.where(top > 0, loads.mean(axis=-1) / np.where(top > 0, top, 1.0), 1.0)
    return float(b) if b.ndim == 0 else [float(x) for x in b]


# ----------------------------------------------------------------------------- process state
class Sampler:
    """Deterministic pass-id sampling, identical on every rank (see the module docstring)."""

    def __init__(self, fraction: float):
        self.fraction = float(fraction)
        self.period = max(1, round(1.0 / self.fraction)) if self.fraction > 0 else 0

    def decide(self, pass_id: int) -> str | None:
        if self.period == 0:
            return None
        phase = pass_id % self.period
        if phase == 0:
            return "stages"
        if self.period >= 2 and phase == self.period // 2:
            return "graph"
        return None


class Control:
    """The runtime control file (see the module docstring): its fraction, read only when changed."""

    def __init__(self, path: str, every: int = CONTROL_EVERY):
        self.path, self.every = str(path), max(1, int(every))
        self._file = ControlFile(self.path)

    def due(self, pass_id: int) -> bool:
        return pass_id % self.every == 0

    def read(self) -> float | None:
        """The file's fraction when it changed since the last read; None when unchanged, missing
        or bad (the current fraction stays)."""
        got = self._file.changed()
        if got is None:
            return None
        key, word = got
        try:
            from sglang_h20.settings import _fraction

            return _fraction(word)
        except Exception as e:
            _warn_once("control:" + repr(key), "observe: control file %s ignored (%s)", self.path, e)
            return None


class _State:
    def __init__(self):
        self.sampler = Sampler(0.0)
        self.control: Control | None = None
        self.recorder: StageRecorder | None = None
        self.exporter = None
        self.out_dir: str | None = None
        self.force_eager = False
        self.graph_would_run: bool | None = None
        self.graph_samples = True  # capture instrumented graph twins (off after a failed capture)
        self.graph_clock = GraphClock  # the templates' clock (tests swap in a fake)
        self.templates: dict[tuple, _Template] = {}  # (graph runner id, size, stream) -> template
        self.graph_request = False  # this pass is sampled: replay the instrumented twin if there is one
        self.graph_hit: tuple | None = None  # (template, graph size) the pass's replay used
        self.disabled: str | None = None
        self.warned: set[str] = set()


_state = _State()
_ACTIVE: StageRecorder | None = None  # set only while a sampled step runs: the hot-path check


def configure(fraction: float, out_dir: str | None = None, exporter=None, recorder=None,
              control: Control | str | None = None) -> None:
    """Set the sampling fraction, where records go and the control file (hooks() calls this)."""
    _state.sampler = Sampler(fraction)
    _state.control = Control(control) if isinstance(control, str) else control
    _state.out_dir = out_dir
    _state.exporter = exporter
    _state.recorder = recorder
    _state.disabled = None


def reset_state() -> None:
    global _state, _ACTIVE
    _state, _ACTIVE = _State(), None


def _warn_once(key: str, msg: str, *args) -> None:
    if key not in _state.warned:
        _state.warned.add(key)
        log.warning(msg, *args)


def _disable(where: str, e: BaseException) -> None:
    global _ACTIVE
    _ACTIVE = None
    _state.force_eager = False
    _state.disabled = f"{where}: {type(e).__name__}: {e}"
    _warn_once("disabled", "observe off after an error in %s", _state.disabled)


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:
        pass
    return int(os.environ.get("RANK", "0"))


def _get_recorder() -> StageRecorder:
    if _state.recorder is None:
        _state.recorder = StageRecorder(rank=_rank())
    return _state.recorder


def _get_exporter():
    if _state.exporter is None:
        from sglang_h20.observe import export

        _state.exporter = export.Exporter.for_process(_state.out_dir, _get_recorder().rank)
    return _state.exporter


def drain() -> int:
    """Export every finished sample (called at the start of each pass; never syncs)."""
    rec = _state.recorder
    if rec is None or not rec.pending():
        return 0
    records = rec.poll()
    if records:
        exporter = _get_exporter()
        for r in records:
            exporter.emit(r)
    return len(records)


def _mode_name(forward_batch) -> str:
    mode = getattr(forward_batch, "forward_mode", None)
    name = getattr(mode, "name", str(mode))
    return str(name).lower()


def _batch_meta(forward_batch, mode: str) -> dict:
    meta = {"mode": mode, "eager": True}
    for key in ("batch_size",):
        v = getattr(forward_batch, key, None)
        if isinstance(v, int):
            meta[key] = v
    ids = getattr(forward_batch, "input_ids", None)
    if ids is not None and hasattr(ids, "shape") and len(ids.shape) >= 1:
        meta["num_tokens"] = int(ids.shape[0])
    return meta


def _capturing() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    except Exception:
        return False


def poll_control(runner, pass_id: int) -> None:
    """Apply the control file's fraction at a due pass, the same pass on every rank of the TP group."""
    ctl = _state.control
    if ctl is None or not ctl.due(pass_id) or _capturing():
        return
    group = getattr(runner, "tp_group", None)
    shared = group is not None and getattr(group, "world_size", 1) > 1
    value = ctl.read() if not shared or group.rank_in_group == 0 else None
    if shared:  # gloo on the group's CPU channel (not its message queue, which SGLang drives)
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=group.ranks[0], group=group.cpu_group)
        value = box[0]
    if value is not None and value != _state.sampler.fraction:
        _state.sampler = Sampler(value)
        log.info("observe: fraction %s from %s at pass %d", value, ctl.path, pass_id)


# ----------------------------------------------------------------------------- hook functions
def on_model_runner_forward(orig, runner, forward_batch, *args, **kwargs):
    """AROUND ModelRunner.forward: sample decision, step window, export of finished samples."""
    global _ACTIVE
    if getattr(runner, "is_draft_worker", False):
        return orig(runner, forward_batch, *args, **kwargs)
    if _state.control is not None:
        try:  # before any early return: every rank must reach the broadcast
            poll_control(runner, int(getattr(runner, "forward_pass_id", 0)) + 1)
        except Exception as e:
            _warn_once("control", "observe: control file not applied (%s: %s)", type(e).__name__, e)
    if _state.disabled is not None or _state.sampler.period == 0:
        if _state.disabled is None and _state.recorder is not None and _state.recorder.pending():
            try:  # samples still in flight when the control switched observation off
                drain()
            except Exception as e:
                _disable("ModelRunner.forward (drain)", e)
        return orig(runner, forward_batch, *args, **kwargs)
    try:
        drain()
        mode = _mode_name(forward_batch)
        pass_id = int(getattr(runner, "forward_pass_id", 0)) + 1  # forward() increments it first
        what = _state.sampler.decide(pass_id) if mode in DECODE_MODES and not _capturing() else None
        rec = _get_recorder() if what else None
        if rec is not None and not rec.can_sample():
            _warn_once("pending", "observe: samples are not completing, skipping sampled passes")
            what = None
    except Exception as e:
        _disable("ModelRunner.forward (before)", e)
        return orig(runner, forward_batch, *args, **kwargs)
    if what is None:
        return orig(runner, forward_batch, *args, **kwargs)
    if what == "stages" and _state.graph_samples and _state.templates:
        return _graph_sampled_pass(orig, runner, forward_batch, rec, pass_id, mode, args, kwargs)
    if what == "graph":
        window = rec.begin_window(pass_id, {"mode": mode, **_batch_meta(forward_batch, mode), "eager": False})
        out = orig(runner, forward_batch, *args, **kwargs)
        try:  # keep only passes that really replayed a graph
            rec.end_window(window, keep=bool(getattr(out, "can_run_graph", False)))
        except Exception as e:
            _disable("ModelRunner.forward (graph window)", e)
        return out
    ok = False
    try:
        _state.force_eager, _state.graph_would_run = True, None
        rec.begin_step(pass_id, _batch_meta(forward_batch, mode))
        _ACTIVE = rec
        out = orig(runner, forward_batch, *args, **kwargs)
        ok = True
        return out
    finally:
        _ACTIVE = None
        _state.force_eager = False
        try:
            rec.end_step(discard=not ok, graph_would_run=_state.graph_would_run)
        except Exception as e:
            _disable("ModelRunner.forward (after)", e)


def _graph_sampled_pass(orig, runner, forward_batch, rec, pass_id, mode, args, kwargs):
    """A sampled pass with instrumented graphs: replay the twin of the batch's graph (if it has one and
    its last sample was read) and queue its template's events; otherwise the pass goes unsampled."""
    start = rec.clock.mark()
    _state.graph_request, _state.graph_hit = True, None
    try:
        out = orig(runner, forward_batch, *args, **kwargs)
    finally:
        _state.graph_request = False
    hit, _state.graph_hit = _state.graph_hit, None
    try:
        if hit is None:
            rec.clock.release([start])
        else:
            tmpl, size = hit
            meta = {**_batch_meta(forward_batch, mode), "eager": False, "graph_sampled": True, "graph_size": size}
            rec.queue_graph_sample(tmpl, pass_id, meta, start)
    except Exception as e:
        _disable("ModelRunner.forward (graph sample)", e)
    return out


def on_capture_one_shape(orig, graph_runner, size, forward, stream_idx=None, variant_label=None, *args, **kwargs):
    """AROUND DecodeCudaGraphRunner.capture_one_shape: after SGLang's capture of a batch size, capture its
    instrumented twin (module doc); a failure falls back to eager sampling, with one warning."""
    global _ACTIVE
    out = orig(graph_runner, size, forward, stream_idx, variant_label, *args, **kwargs)
    if variant_label is not None or not _state.graph_samples or _state.disabled is not None \
            or getattr(getattr(graph_runner, "model_runner", None), "is_draft_worker", False):
        return out
    backend = type(getattr(graph_runner, "backend", None)).__name__
    if backend not in TWIN_BACKENDS:  # breakable / piecewise graphs run Python between segments
        _warn_once("twin_backend", "observe: no instrumented graphs with the %s graph backend; sampled passes "
                   "run eagerly", backend)
        return out
    import functools

    tmpl_rec = StageRecorder(clock=_state.graph_clock(), rank=_rank())

    @functools.wraps(forward)  # SGLang inspects the forward's signature (pp_proxy_tensors, input_embeds)
    def instrumented(*a, **kw):
        global _ACTIVE
        if not _capturing():
            return forward(*a, **kw)  # warm-up runs: untimed
        tmpl_rec.begin_step(0, {"mode": "decode"})
        _ACTIVE = tmpl_rec
        try:
            return forward(*a, **kw)
        finally:
            _ACTIVE = None
            tmpl_rec.end_step(template=True)

    try:
        orig(graph_runner, size, instrumented, stream_idx, GRAPH_VARIANT, *args, **kwargs)
        tmpl = tmpl_rec.take_template()
        if tmpl is None:
            raise RuntimeError("the instrumented capture recorded no frames")
        _state.templates[(id(graph_runner), int(size), stream_idx)] = tmpl
    except Exception as e:
        _ACTIVE = None
        _state.graph_samples = False
        _state.templates.clear()
        _warn_once("graph_capture", "observe: instrumented graph capture failed at size %s (%s: %s); sampled "
                   "passes run eagerly instead", size, type(e).__name__, e)
    return out


def on_make_graph_key(orig, graph_runner, size, stream_idx=None, variant_label=None, *args, **kwargs):
    """AROUND DecodeCudaGraphRunner._make_graph_key: on a sampled pass, the instrumented twin's key."""
    if _state.graph_request and variant_label is None and not _capturing():
        tmpl = _state.templates.get((id(graph_runner), int(size), stream_idx))
        if tmpl is not None and not tmpl.in_flight:
            _state.graph_hit = (tmpl, int(size))
            return orig(graph_runner, size, stream_idx, GRAPH_VARIANT, *args, **kwargs)
    return orig(graph_runner, size, stream_idx, variant_label, *args, **kwargs)


def on_can_run_graph(orig, graph_runner, forward_batch, *args, **kwargs):
    """AROUND DecodeCudaGraphRunner.can_run_graph: a sampled pass runs eagerly."""
    answer = orig(graph_runner, forward_batch, *args, **kwargs)
    if _state.force_eager:
        _state.graph_would_run = bool(answer)
        return False
    return answer


def _frame_hook(kind: str, label: str, then: str | None = None, then_parent: str | None = None,
                no_nest: bool = False, skip_inside: str | None = None):
    """An AROUND hook that opens a frame around the call while a sampled step runs."""

    def hook(orig, *args, **kwargs):
        rec = _ACTIVE
        if rec is None:
            return orig(*args, **kwargs)
        if (no_nest and rec.top_kind() == kind) or (skip_inside and rec.inside(skip_inside)):
            return orig(*args, **kwargs)
        frame = rec.push(kind, label, then=then, then_parent=then_parent)
        try:
            return orig(*args, **kwargs)
        finally:
            rec.pop(frame)

    hook.__name__ = hook.__qualname__ = f"observe_{kind}_{label}"
    return hook


def on_decoder_layer(orig, layer, *args, **kwargs):
    rec = _ACTIVE
    if rec is None:
        return orig(layer, *args, **kwargs)
    frame = rec.push("layer", "layer_other", layer=int(getattr(layer, "layer_id", -1)))
    try:
        return orig(layer, *args, **kwargs)
    finally:
        rec.pop(frame)


def _experts_meta(experts) -> dict:
    return {"num_experts": int(getattr(experts, "num_experts", 0) or 0),
            "experts_per_rank": int(getattr(experts, "num_local_experts", 0) or 0),
            "ep_size": int(getattr(experts, "moe_ep_size", 1) or 1)}


def on_moe(orig, moe, *args, **kwargs):
    rec = _ACTIVE
    if rec is None:
        return orig(moe, *args, **kwargs)
    try:
        rec.moe_meta = None if getattr(moe, "is_nextn", False) else _experts_meta(moe.experts)
    except Exception:
        rec.moe_meta = None
    frame = rec.push("moe", "moe_other")
    try:
        return orig(moe, *args, **kwargs)
    finally:
        rec.pop(frame)
        rec.moe_meta = None


def on_topk(orig, topk, *args, **kwargs):
    rec = _ACTIVE
    if rec is None:
        return orig(topk, *args, **kwargs)
    frame = rec.push("router", "router")
    try:
        out = orig(topk, *args, **kwargs)
    finally:
        rec.pop(frame)
    try:
        meta, ids = rec.moe_meta, getattr(out, "topk_ids", None)
        if meta and ids is not None and rec._stack:
            layer = next((f.layer for f in reversed(rec._stack) if f.layer is not None), None)
            rec.record_load(layer, ids, **meta)
    except Exception as e:
        _warn_once("load", "observe: expert load not recorded (%s: %s)", type(e).__name__, e)
    return out


on_attention = _frame_hook("attention", "attention")
on_gate = _frame_hook("router", "router")
on_shared = _frame_hook("shared", "shared_expert", no_nest=True)
on_experts = _frame_hook("experts", "dispatch", no_nest=True)
on_routed = _frame_hook("routed", "routed_experts", then="combine", then_parent="experts", no_nest=True)
on_dense = _frame_hook("dense", "dense_mlp", skip_inside="moe")


def hooks(settings) -> list[Hook]:
    """The observe feature's whole patch surface (SGLANG_H20_OBSERVE = fraction of decode passes)."""
    fraction = float(settings["observe"])
    values = getattr(settings, "values", {}) or {}
    out_dir = values.get("observe_dir") or os.environ.get("SGLANG_H20_OBSERVE_DIR") or None
    configure(fraction, out_dir, control=values.get("observe_control") or None)
    return [
        Hook(STEP_TARGET, on_model_runner_forward, "around"),
        Hook(GRAPH_TARGET, on_can_run_graph, "around"),
        Hook(CAPTURE_TARGET, on_capture_one_shape, "around"),
        Hook(KEY_TARGET, on_make_graph_key, "around"),
        Hook(LAYER_TARGET, on_decoder_layer, "around"),
        Hook(ATTENTION_TARGET, on_attention, "around"),
        Hook(MOE_TARGET, on_moe, "around"),
        Hook(GATE_TARGET, on_gate, "around"),
        Hook(TOPK_TARGET, on_topk, "around"),
        Hook(SHARED_TARGET, on_shared, "around"),
        *[Hook(t, on_experts, "around") for t in EXPERTS_TARGETS],
        *[Hook(t, on_routed, "around") for t in ROUTED_TARGETS],
        Hook(DENSE_TARGET, on_dense, "around"),
    ]
