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

How a step's frames become exclusive per-layer, per-stage times, and the records' load statistics:
`sglang_h20.observe.recorder` (this module drives it).
"""
from __future__ import annotations

import logging
import os

from sglang_h20.controlfile import ControlFile
from sglang_h20.features import Hook
from sglang_h20.observe.recorder import GraphClock, StageRecorder, Template

log = logging.getLogger("sglang_h20.observe")

# ----------------------------------------------------------------------------- hook targets
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
CONTROL_EVERY = 32  # passes between checks of the control file


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
        self.templates: dict[tuple, Template] = {}  # (graph runner id, size, stream) -> template
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
