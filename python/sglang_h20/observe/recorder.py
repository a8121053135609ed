"""The stage recorder behind `sglang_h20.observe.stages`: a stack of timed frames per decode step, turned into
exclusive per-layer, per-stage times; its clocks (CPU, CUDA events, a graph's external events) and the per-rank
expert-load statistics of its records. It knows nothing of SGLang: the hooks that drive it live in `stages`.

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
import time
from collections import deque
from typing import Any

# ----------------------------------------------------------------------------- vocabulary
STAGES = ("attention", "router", "dispatch", "routed_experts", "combine", "shared_expert",
          "dense_mlp", "moe_other", "layer_other")
OUTSIDE = "outside_layers"  # step time outside every layer frame
COMMUNICATION_STAGES = ("dispatch", "combine")
EXPERT_STAGES = ("routed_experts",)
COMPUTE_STAGES = tuple(s for s in STAGES if s not in COMMUNICATION_STAGES + EXPERT_STAGES)
MAX_PENDING = 4  # samples waiting for their events; a new sample is skipped beyond this


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
    template: Any = None  # the Template whose events these are (graph samples: never released)


@dataclasses.dataclass
class Template:
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
        self._captured: Template | None = None  # the last end_step(template=True)

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
                self._captured = Template(sample)
            else:
                self._pending.append(sample)
        self._stack, self._timeline, self._overlap, self._loads = [], [], [], {}

    def take_template(self) -> Template | None:
        """The step a capture just closed, as a graph template (None if the capture recorded none)."""
        tmpl, self._captured = self._captured, None
        return tmpl

    def queue_graph_sample(self, tmpl: Template, step: int, meta: dict, start) -> None:
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
