"""Asynchronous, hierarchical expert-weight migration that never stalls decode.

SGLang 0.5.17 rebalances in one blocking call (`ExpertLocationUpdater.update`, driven by
`EPLBManager.rebalance`): every rank posts its P2P ops, waits for all of them, copies the received
weights into the live expert slots and only then runs the next forward pass. With DeepSeek-V3
(44 MB per expert, 58 MoE layers) that is seconds of lost decode. We split it into a PLANNER,
`sglang_h20.eplb.migration_plan.plan_migration` (which copies, sourced hierarchically: local, NVLink, network
once per node then forwarded; packed into chunks that fit a staging budget), and the EXECUTOR here,
`MigrationExecutor`, that runs the plan off the critical path, in one of two launch modes.

``bytes_per_boundary`` (the plugin's default, "boundary"): `maybe_switch` itself posts, at every
boundary, the next transfers of the plan's fixed order (chunks, their stages, transfer ids), at most
`bytes_per_boundary` sent and as much received per rank; every rank walks the same order and advances the
same transfers at the same boundary, posting only its own ops, and a chunk opens (takes its rows of the
staging pool, made with the executor) at the boundary after the previous chunk's layers switched. The walk is
a schedule fixed when the executor is built (`boundary_schedule`: one batch of transfers per boundary). Posting
never waits: NCCL ops and local copies go onto the side stream in that order (stream order makes a forward
wait for its recv); a WAITER thread watches them complete (on gloo it posts them, in order, and waits), told
only after the batches that finish a layer or a chunk, or every FLUSH_EVERY-th (one event, one notify). So the
migration's NCCL kernels are launched at the same point among the model's own on every rank. In a
real EP-2 server on two H200s the thread mode below hung both GPUs: two communicators whose kernels
ranks launch in different orders can wait on each other forever.

``max_bytes_per_s`` / neither ("thread"): a background TRANSFER thread runs chunk after chunk: it
allocates the chunk's staging buffers, then for each stage posts this rank's `isend`/`irecv` (gloo
on CPU; NCCL `batch_isend_irecv` on a side CUDA stream on GPU) and local copies into STAGING buffers
(never into live weights) and waits for them with a deadline. When all of this rank's incoming
transfers of a layer have completed, the layer is locally ready. The next chunk starts once the
previous chunk's layers have switched and their staging is freed, so staging in use never exceeds
the budget.

PEER COPIES (`peer_weights`, from `peer_copies.share_weights`): where every rank of the world could map the expert
tensors of the other ranks of its node (CUDA IPC handles; shared files on the CPU), an ``nvlink`` transfer is
not a send/recv pair: its destination PULLS the expert from the source's old slot with a plain copy (on GPUs the
copy engines over NVLink: no SMs, no NCCL kernels beside the model's, and one side posts, not two). The
source's old slot stays valid until every rank reported the layer ready, so the pull needs no signal from its
source. ``network`` transfers and forwards out of a peer's staging keep the process group. A plan that then
needs no process group at all (`group_free`: one node) can run in the thread mode whatever the launch setting:
its pulls are posted by the transfer thread, paced, and the decode loop only switches.

Switching happens only in `maybe_switch()`, which the decode loop calls once BETWEEN forward
passes on every rank. For the layers it switches it copies staging into the live slots (same
tensors, so CUDA graphs stay valid; on GPU the copy is ordered on the compute stream) and
replaces the layer's routing row (physical slot -> logical expert): each forward pass sees, per
layer, either the old slots + old map or the new slots + new map.

Switching protocol (every rank switches a layer at the same step boundary)
------------------------------------------------------------------------
All ranks call `start()` at the same step boundary and then `maybe_switch()` exactly once per
boundary (true in SGLang: EP ranks run the same forward passes, and `EPLBManager` is driven by
`on_forward_pass_end` on every rank). Boundary b counts calls since `start()`. Decision ROUND r
takes effect at boundary B_r = (r + 1) * switch_every. Agreement uses the c10d key-value store
(the TCPStore every process group already has; hosted by the launcher or rank 0):

* ready counters: a rank adds 1 to ``ready/<layer>`` once the layer is locally ready (a rank
  without incoming transfers for a layer adds at the start of its chunk). Counter == world means
  every rank holds all the layer's new weights in staging (and every send of it has been
  consumed, since each send has a receiver that is ready).
* decisions: round r's decision is the value of key ``round/<r>``, written with
  `compare_set(key, "", value)`: the first writer wins and every rank reads the same value.
  A background CONTROL thread proposes, once its rank has passed boundary B_r - decide_ahead,
  ``S:<layers whose counter == world>`` (or ``A:<reason>`` after a local failure). Whatever is
  stored is what every rank applies at B_r.
* `maybe_switch` never waits: at B_r it applies the decision if the control thread already has
  it (the normal case: it is fetched `decide_ahead` boundaries early); otherwise it proposes
  ``S:`` (switch nothing this round) itself with one compare_set (one store round trip, ~0.1 ms)
  and applies whatever won. Between boundaries it only increments a counter.
Hence every rank switches the same layers at the same boundary, for any skew between ranks' decode
loops and any delay of the control threads; a slow rank only makes the others defer a round.

Fault handling
--------------
A failed or timed-out transfer (each stage's waits have a deadline of `timeout_s` from posting;
gloo reports a dead peer at once as "connection closed"), a store error, or no global progress for
`watchdog_s` (default 2 * timeout_s; covers a peer that stopped without us waiting on it) makes
the rank propose ``A:<reason>`` for the next undecided round. The abort is then applied by every
surviving rank at the same boundary: layers that switched in earlier rounds keep the new placement
(they switched on all ranks together, so each layer is still consistent everywhere); every other
layer keeps its old weights and old routing row; staging is dropped; threads stop at their next
check (a thread blocked in a wait leaves at its deadline); one ERROR line per rank says which
layers were aborted and why; `status` reports ``aborted`` with the reason. A gloo wait that times
out closes that pair and NCCL ops cannot be cancelled (on CUDA we abort the migration group), so
after an abort the migration group must be re-created before the next migration. When the abort comes
from the watchdog, the control thread aborts the NCCL group at once rather than at the boundary: a
device-level wait (both GPUs spinning, as in the EP-2 server hang) may keep the decode loop from
reaching one, and ending the migration's kernels frees it. The store must
outlive the failed rank (true for torchrun's agent-hosted store); if the store itself is lost,
each rank aborts locally and consistency can no longer be guaranteed.

Known limits: migration advances only while decode steps run (switching needs boundaries; an idle
server would have to call `maybe_switch` from its idle loop, in lockstep on all ranks); the
executor expects a dedicated process group (`group`) so that its P2P ops never interleave with the
model's own collectives; for NCCL that group must be initialised eagerly (one collective on it at
creation) because the first op on a group must include all ranks. CI tests the CPU/gloo path
(test/cpu/test_eplb_migration*.py); the CUDA path has GPU tests (test/gpu/test_eplb_migration_gpu.py on one
GPU; the peer-copy test needs two) and ran in real EP-2 servers (benchmark/results/eplb/README.md).

Where it plugs into SGLang 0.5.17: `sglang_h20.eplb.async_rebalance` (switch eplb_async) replaces the blocking
update of `EPLBManager.rebalance` with a planner + executor run, driven by the same generator (each `yield` is one
forward pass on every rank); its docstring lists the hook targets.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import logging
import threading
import time
import zlib
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from sglang_h20.eplb import throttle
from sglang_h20.eplb.migration_plan import Chunk, MigrationPlan, Stage, Transfer, boundary_schedule
from sglang_h20.eplb.placement import Placement, Topology

log = logging.getLogger("sglang_h20.eplb.migration")


@dataclasses.dataclass(frozen=True)
class MigrationStatus:
    state: str                          # "pending" | "running" | "done" | "aborted"
    switched_layers: tuple[int, ...]    # on the new placement (switched on every rank together)
    pending_layers: tuple[int, ...]     # still on the old placement
    ready_layers: tuple[int, ...]       # locally complete, not switched yet
    switch_boundary: Mapping[int, int]  # layer -> boundary (maybe_switch call) it switched at
    error: str | None
    boundary: int
    staging_bytes: int
    peak_staging_bytes: int
    bytes_received: int
    deferred_rounds: int                # rounds this rank had to settle itself at the boundary
    max_switch_s: float                 # longest maybe_switch call
    pulled_bytes: int = 0               # posted as pulls from a peer's mapped weights (peer copies), counted when
    #                                     posted (bytes_received counts arrivals)


_SEQ = itertools.count()
_TAG_SPAN = 1 << 20


class MigrationExecutor:
    """Runs a MigrationPlan on one rank; see the module docstring for the protocol.

    rank/world: this rank in `group` (= its GPU index in `topology`); `weights`: layer -> this
    rank's live expert tensors, a Tensor [slots_per_gpu, ...] or a list of them (SGLang's
    `routed_experts_weights_of_layer`); `group`: a process group dedicated to migration (None:
    the default group); `timeout_s`: deadline of every stage's waits.

    Use: `ex.start()` at the same step boundary on every rank, then `ex.maybe_switch()` after
    every forward pass; route with `ex.routing_map` (or `ex.placement`); read `ex.status`.
    `on_switch(layers)`, if given, runs inside maybe_switch right after those layers' weights were
    swapped in (e.g. to update SGLang's ExpertLocationMetadata for the same layers).
    `peer_weights` ({(peer rank, layer): its expert tensors, mapped here}, from `peer_copies.share_weights`; the same
    choice on every rank): nvlink transfers become pulls by their destination (module docstring, PEER COPIES).
    `max_bytes_per_s` paces what this rank moves (one expert at a time: local copies, pulls, and on GPUs one
    NCCL group per transfer; gloo posts a stage at once, paced by its bytes): decode steps are
    HBM-bound, so an unpaced side-stream copy slows every step it overlaps by its whole bandwidth
    share; paced, the cost is spread thin. None: unpaced.
    """

    def __init__(self, rank: int, world: int, topology: Topology,
                 weights: Mapping[int, torch.Tensor | Sequence[torch.Tensor]], plan: MigrationPlan,
                 group=None, timeout_s: float = 60.0, *, store=None, switch_every: int = 4,
                 decide_ahead: int = 2, watchdog_s: float | None = None,
                 migration_id: str | None = None,
                 on_switch: Callable[[list[int]], None] | None = None,
                 max_bytes_per_s: float | None = None, bytes_per_boundary: int | None = None,
                 peer_weights: Mapping[tuple[int, int], Sequence[torch.Tensor]] | None = None):
        if world != topology.num_gpus:
            raise ValueError(f"world {world} != {topology.num_gpus} GPUs of the topology")
        if plan.old.topology != topology:
            raise ValueError("plan was made for another topology")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside world {world}")
        if switch_every < 1 or not 0 <= decide_ahead < switch_every:
            raise ValueError("need switch_every >= 1 and 0 <= decide_ahead < switch_every")
        self.rank, self.world, self.topology, self.plan = rank, world, topology, plan
        self._k = topology.slots_per_gpu
        self._weights: dict[int, list[torch.Tensor]] = {}
        for l, w in weights.items():
            ws = [w] if isinstance(w, torch.Tensor) else list(w)
            if any(t.shape[0] != self._k for t in ws):
                raise ValueError(f"layer {l}: expert tensors must have {self._k} slots in dim 0")
            self._weights[int(l)] = ws
        for l in plan.layers:
            if l not in self._weights:
                raise ValueError(f"no weights for layer {l}")
            nbytes = sum(t[0].numel() * t[0].element_size() for t in self._weights[l])
            if nbytes != plan.expert_bytes:
                raise ValueError(f"layer {l}: an expert has {nbytes} B, the plan assumed "
                                 f"{plan.expert_bytes} B (staging budget would be wrong)")
        self._ntensors = max((len(self._weights[l]) for l in plan.layers), default=1)
        if len(plan.transfers) * self._ntensors >= _TAG_SPAN:
            raise ValueError("plan too large for the P2P tag space")
        any_w = next(iter(self._weights[plan.layers[0]])) if plan.layers else None
        self._device = any_w.device if any_w is not None else torch.device("cpu")
        self._cuda = self._device.type == "cuda"
        self._stream = torch.cuda.Stream(self._device) if self._cuda else None
        t0 = time.perf_counter()
        self._chunk_views = self._make_staging()
        t1 = time.perf_counter()
        # the slot views this rank sends or copies from, made here too, not indexed again at every boundary (the
        # decode loop's bookkeeping per boundary; its effect in a server is not measured)
        self._sources = {}
        for t in plan.transfers:
            if t.src_rank == rank and not t.from_staging:
                throttle.point()
                self._sources[t.tid] = [w[t.src_slot - rank * self._k] for w in self._weights[t.layer]]
        self._freed = None  # CUDA event after the last switch's copies out of the pool (decode stream)
        self._group = group
        self._on_switch = on_switch
        self._start_event = None
        self.timeout_s = float(timeout_s)
        self._watchdog_s = 2.0 * self.timeout_s if watchdog_s is None else float(watchdog_s)
        self._every, self._ahead = int(switch_every), int(decide_ahead)
        if max_bytes_per_s is not None and max_bytes_per_s <= 0:
            raise ValueError("max_bytes_per_s must be positive (None: unpaced)")
        self._rate = max_bytes_per_s
        if bytes_per_boundary is not None and (bytes_per_boundary <= 0 or max_bytes_per_s is not None):
            raise ValueError("bytes_per_boundary must be positive, and excludes max_bytes_per_s")
        # boundary mode: transfers per rank and boundary (each is one expert; a rank counts those it sends and
        # those it receives apart, in the plan's order, the same walk on every rank); None: thread mode
        self._per_boundary = (None if bytes_per_boundary is None
                              else max(1, int(bytes_per_boundary) // max(1, plan.expert_bytes)))
        # boundary mode: per chunk, the transfers posted at each of its boundaries, and after which of those the
        # waiter is told (the same on every rank); made here, not walked again at every boundary
        self._batches, self._flush = boundary_schedule(plan, self._per_boundary or 1)
        # where building this executor took its time (a rebalance's log line; the staging pool is GBs)
        self.build_ms = {"staging": round(1e3 * (t1 - t0), 3),
                         "views_schedule": round(1e3 * (time.perf_counter() - t1), 3)}
        self._cursor = (0, 0)        # boundary mode: (chunk, batch) posted next
        self._opened: set[int] = set()
        self._launched: list = []    # boundary mode: posted groups of batches for the waiter thread, in order
        self._unflushed: list = []   # boundary mode, gloo: units for the waiter since it was last told
        self._unflushed_tids: set[int] = set()  # ... the tids they receive here
        self._unflushed_t: float | None = None  # ... when the first of them was posted (None: nothing posted since)
        self._pace_t = 0.0  # monotonic time before which the next paced transfer may not start
        self.migration_id = migration_id if migration_id is not None else f"m{next(_SEQ)}"
        self._tag_base = (zlib.crc32(self.migration_id.encode()) % 1024) * _TAG_SPAN
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        self._store = dist.PrefixStore(f"sglang_h20/eplb_migration/{self.migration_id}/", base)

        self._phy2log = plan.old.phy2log.copy()   # live routing map, rows replaced at switch
        self._all_layers = frozenset(plan.layers)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._state = "pending"
        self._boundary = 0
        self._next_round = 0
        self._decisions: dict[int, tuple[str, object]] = {}
        self._switched: dict[int, int] = {}       # layer -> boundary
        self._ready: set[int] = set()
        self._staging: dict[int, list[torch.Tensor]] = {}  # tid -> views into its layer's block
        # layer -> (slot index tensor, runs of consecutive slots, one staging block per weight tensor
        # [incoming, ...], rows of the pool): the switch is a few slice copies or one index_copy_ per tensor
        # (_copy_rows), not one copy per expert (1024 launches for 256 slots x 4)
        self._blocks: dict[int, tuple[torch.Tensor, tuple, list[torch.Tensor]]] = {}
        self._staging_bytes = self._peak_staging = self._bytes_received = self._pulled = 0
        self._peer = dict(peer_weights) if peer_weights is not None else None
        self._local_abort: str | None = None
        self._error: str | None = None
        self._stop = False
        self._last_progress = time.monotonic()
        self._wake_at = 0          # boundary at which maybe_switch wakes the control thread
        self._deferred = 0
        self._max_switch_s = 0.0
        self._threads: list[threading.Thread] = []
        self._group_aborted = False

    # ---------------------------------------------------------------- decode-thread API
    def start(self) -> None:
        """Begin; call at the same step boundary on every rank."""
        with self._lock:
            if self._state != "pending":
                raise RuntimeError(f"migration already {self._state}")
            self._state = "running" if self._all_layers else "done"
            self._last_progress = time.monotonic()
        if self._cuda:  # the side stream must see every earlier write to the live weights
            self._start_event = torch.cuda.Event()
            self._start_event.record(torch.cuda.current_stream(self._device))
            if self._per_boundary is not None:  # boundary mode posts from this thread, maybe before the waiter runs
                self._stream.wait_event(self._start_event)
        if not self._all_layers:
            return
        mover = ("transfer", self._transfer_main) if self._per_boundary is None else ("waiter", self._waiter_main)
        for name, fn in (mover, ("control", self._control_main)):
            t = threading.Thread(target=fn, name=f"eplb-migration-{name}-r{self.rank}", daemon=True)
            t.start()
            self._threads.append(t)

    def maybe_switch(self) -> list[int]:
        """Call once per step boundary (between forward passes). Returns the layers switched now.

        Never waits for transfers: at a decision boundary it applies the agreed decision, or,
        if it is not known yet, settles the round as "switch nothing" with one store round trip.
        """
        if self._state != "running":
            return []
        t0 = time.perf_counter()
        with self._cv:
            self._boundary += 1
            b, r = self._boundary, self._next_round
            if b >= self._wake_at:  # the control thread waits for this boundary
                self._cv.notify_all()
            due = b >= (r + 1) * self._every
            dec = self._decisions.get(r) if due else None
        if not due:
            if self._per_boundary is not None:
                self._launch()
            self._max_switch_s = max(self._max_switch_s, time.perf_counter() - t0)
            return []
        if dec is None:
            try:
                dec = _parse(self._store.compare_set(_round_key(r), "", "S:"))
            except Exception as e:  # store lost: nothing can be agreed any more
                dec = ("abort", f"rank {self.rank}: store unreachable at boundary {b}: {e}")
            with self._lock:
                dec = self._decisions.setdefault(r, dec)
                self._deferred += 1
        switched = self._apply(r, b, dec)
        with self._cv:
            self._next_round = r + 1
            self._cv.notify_all()
        if self._per_boundary is not None:  # after the switch: a chunk may open on the staging it freed
            self._launch()
        self._max_switch_s = max(self._max_switch_s, time.perf_counter() - t0)
        return switched

    @property
    def routing_map(self) -> np.ndarray:
        """[L, S] physical slot -> logical expert now in force (read-only view)."""
        v = self._phy2log.view()
        v.flags.writeable = False
        return v

    @property
    def placement(self) -> Placement:
        return Placement(self._phy2log.copy(), self.topology, self.plan.old.num_experts,
                         self.plan.new.algorithm)

    @property
    def status(self) -> MigrationStatus:
        with self._lock:
            sw = dict(self._switched)
            return MigrationStatus(
                state=self._state, switched_layers=tuple(sorted(sw)),
                pending_layers=tuple(sorted(self._all_layers - sw.keys())),
                ready_layers=tuple(sorted(self._ready - sw.keys())), switch_boundary=sw,
                error=self._error, boundary=self._boundary, staging_bytes=self._staging_bytes,
                peak_staging_bytes=self._peak_staging, bytes_received=self._bytes_received,
                deferred_rounds=self._deferred, max_switch_s=self._max_switch_s, pulled_bytes=self._pulled)

    def close(self, timeout: float | None = None) -> None:
        """Stop (aborting if still running) and join the background threads."""
        if self._state == "running":
            self._abort(self._next_round, self._boundary, f"rank {self.rank}: closed while running")
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout)

    # ---------------------------------------------------------------- switching
    def _apply(self, r: int, b: int, dec) -> list[int]:
        kind, payload = dec
        if kind == "abort":
            self._abort(r, b, payload)
            return []
        layers = [l for l in payload if l in self._all_layers and l not in self._switched]
        stream = torch.cuda.current_stream(self._device) if self._cuda else None
        for l in layers:
            if l not in self._ready:  # cannot happen: counter == world includes this rank
                self._abort(r, b, f"rank {self.rank}: protocol error, layer {l} agreed but not ready")
                return []
            tids = self.plan.incoming(self.rank, l)
            with self._lock:
                for tid in tids:
                    del self._staging[tid]
                idx, runs, block = self._blocks.pop(l, (None, (), []))
            freed = None
            for w, staged in zip(self._weights[l], block):
                _copy_rows(w, staged, idx, runs)
                if stream is not None:
                    staged.record_stream(stream)  # the pool, freed when done, outlives these copies
            if stream is not None:
                if idx is not None:
                    idx.record_stream(stream)  # so does the index (made on the side stream)
                freed = torch.cuda.Event()
                freed.record(stream)
            self._phy2log[l] = self.plan.new.phy2log[l]
            with self._cv:
                self._staging_bytes -= len(tids) * self.plan.expert_bytes
                self._freed = freed or self._freed
                self._switched[l] = b
                self._last_progress = time.monotonic()
                if self._all_layers <= self._switched.keys():
                    self._state = "done"
                    self._chunk_views = []
                self._cv.notify_all()
        if layers and self._on_switch is not None:
            self._on_switch(layers)
        if layers and self._state == "done":
            log.info("EPLB migration %s done at step boundary %d: %s", self.migration_id, b,
                     self.plan.summary())
        return layers

    def _abort(self, r: int, b: int, reason: str) -> None:
        with self._cv:
            if self._state in ("done", "aborted"):
                return
            self._state, self._error, self._stop = "aborted", reason, True
            freed, self._staging_bytes = self._staging_bytes, 0
            self._staging.clear()
            self._blocks.clear()
            self._chunk_views = []
            switched = sorted(self._switched)
            aborted = sorted(self._all_layers - self._switched.keys())
            self._cv.notify_all()
        log.error("EPLB migration %s aborted on rank %d at step boundary %d (round %d): %s. "
                  "Layers %s stay on the old placement; layers %s had already switched (on all "
                  "ranks) and keep the new one; %d staging bytes freed.", self.migration_id,
                  self.rank, b, r, reason, aborted, switched, freed)
        self._abort_group()

    def _abort_group(self) -> None:
        """NCCL P2P cannot be cancelled: the dedicated migration group is given up (its kernels end)."""
        if self._cuda and self._group is not None and not self._group_aborted:
            self._group_aborted = True
            try:
                dist.distributed_c10d._abort_process_group(self._group)
            except Exception:  # pragma: no cover - GPU only
                log.debug("could not abort the migration group", exc_info=True)

    # ---------------------------------------------------------------- control thread
    def _control_main(self) -> None:
        try:
            self._control_loop()
        except Exception as e:  # store failure
            self._fail(f"rank {self.rank}: control thread failed: {type(e).__name__}: {e}")

    def _control_loop(self) -> None:
        st = self._store
        stuck = False
        for l in self.plan.layers:
            st.add(_ready_key(l), 0)   # create the counters, so that multi_get never blocks
        st.add("progress", 0)
        seen_progress = -1
        r = 0
        while True:
            with self._cv:
                while True:
                    if self._stop or self._state != "running":
                        return
                    r = max(r, self._next_round)
                    while r in self._decisions:
                        r += 1
                    if self._local_abort is not None:
                        break
                    self._wake_at = (r + 1) * self._every - self._ahead
                    if self._boundary >= self._wake_at:
                        break
                    idle = time.monotonic() - self._last_progress
                    if idle > self._watchdog_s:
                        self._local_abort = (f"rank {self.rank}: no migration progress for "
                                             f"{idle:.1f} s (peers stopped?)")
                        stuck = True
                        break
                    self._cv.wait(timeout=min(0.05, self._watchdog_s))
                abort = self._local_abort
                pending = sorted(self._all_layers - self._switched.keys()
                                 - {l for d in self._decisions.values() if d[0] == "switch"
                                    for l in d[1]})
            if abort is not None:
                if stuck:  # the abort is applied at a boundary; a device-level wait may keep the decode loop
                    self._abort_group()  # from reaching one, so the migration's NCCL kernels are ended now
                value = "A:" + abort
            else:
                keys = [_ready_key(l) for l in pending] + ["progress"]
                vals = [int(v) for v in st.multi_get(keys)]
                if vals[-1] != seen_progress:
                    seen_progress = vals[-1]
                    with self._lock:
                        self._last_progress = time.monotonic()
                value = "S:" + ",".join(str(l) for l, v in zip(pending, vals) if v >= self.world)
            dec = _parse(st.compare_set(_round_key(r), "", value))
            with self._cv:
                dec = self._decisions.setdefault(r, dec)
                self._cv.notify_all()
            if dec[0] == "abort" or set(pending) <= set(dec[1]):
                return
            r += 1

    def _fail(self, reason: str) -> None:
        with self._cv:
            if self._local_abort is None and self._state == "running":
                self._local_abort = reason
                log.debug("EPLB migration %s: %s", self.migration_id, reason)
            self._cv.notify_all()

    # ---------------------------------------------------------------- transfer thread
    def _transfer_main(self) -> None:
        try:
            if self._cuda:  # pragma: no cover - GPU only
                torch.cuda.set_device(self._device)
                self._stream.wait_event(self._start_event)
            for chunk in self.plan.chunks:
                if not self._gate(chunk):
                    return
                self._run_chunk(chunk)
        except Exception as e:
            self._fail(f"rank {self.rank}: {type(e).__name__}: {e}")

    def _on_side_stream(self):
        """The side stream as the current one (a no-op on CPU), for what it writes or sends: memory allocated on
        another stream may be handed out again while that stream's work on it is still queued."""
        return torch.cuda.stream(self._stream) if self._cuda else contextlib.nullcontext()

    def _gate(self, chunk: Chunk) -> bool:
        """Wait until the previous chunk's layers switched (their staging is free)."""
        prev = self.plan.chunks[chunk.index - 1].layers if chunk.index else ()
        with self._cv:
            while not self._stop and not all(l in self._switched for l in prev):
                self._cv.wait(timeout=0.1)
            return not self._stop

    def _make_staging(self) -> list[tuple[dict, dict]]:
        """Per chunk, its views of one staging pool (one block per weight tensor, rows for the largest chunk's
        incoming experts; chunks take its rows from the first) and each layer's slot index (on the device) with
        its runs, made once, when the executor is built: off the decode loop, which in boundary mode opens the
        chunks (allocating a chunk's 5 GB there, and uploading its index from pinned memory, cost a boundary 6 ms
        in an EP-2 server; making a chunk's ~1500 row views there, ~3 ms). The views keep the pool alive."""
        me, plan = self.rank, self.plan
        rows = max((sum(len(plan.incoming(me, l)) for l in c.layers) for c in plan.chunks), default=0)
        like = [(w.shape[1:], w.dtype) for w in self._weights[plan.layers[0]]] if plan.layers else []
        for l in plan.layers:
            if [(w.shape[1:], w.dtype) for w in self._weights[l]] != like:
                raise ValueError(f"layer {l}: expert tensors differ in shape or dtype from layer {plan.layers[0]}'s "
                                 "(one staging pool serves every layer)")
        views = []  # per chunk: (tid -> its staging rows, layer -> (slot index, runs, its block of the pool))
        with self._on_side_stream():  # the side stream writes the pool: allocated there (see _on_side_stream)
            pool = [torch.empty((rows, *shape), dtype=dtype, device=self._device) for shape, dtype in like] \
                if rows else []
            for chunk in plan.chunks:
                bufs, blocks, row = {}, {}, 0
                for l in chunk.layers:
                    tids = sorted(plan.incoming(me, l))
                    if not tids:
                        continue
                    slots = [plan.transfers[tid].dst_slot - me * self._k for tid in tids]
                    idx = torch.tensor(slots, dtype=torch.long)
                    if self._cuda:  # from pageable memory: this (placement) thread waits; nothing pinned
                        idx = idx.to(self._device)
                    block = [p[row:row + len(tids)] for p in pool]
                    row += len(tids)
                    blocks[l] = (idx, _runs(slots), block)
                    for n, tid in enumerate(tids):
                        throttle.point()
                        bufs[tid] = [b[n] for b in block]
                views.append((bufs, blocks))
        if self._cuda:
            self._stream.synchronize()  # the index uploads, before any switch reads them on another stream
        return views

    def _open_chunk(self, chunk: Chunk) -> bool:
        """Hand the chunk its staging: per layer with incoming experts, its rows of the pool (views made with the
        executor); False once stopped. The side stream first waits, on the GPU, for the previous chunk's switch
        copies out of those rows (queued on the decode loop's stream)."""
        with self._cv:
            if self._stop:
                return False
            freed = self._freed
            bufs, blocks = self._chunk_views[chunk.index]
        if freed is not None:
            self._stream.wait_event(freed)
        with self._cv:
            if self._stop:
                return False
            self._staging.update(bufs)
            self._blocks.update(blocks)
            self._staging_bytes += len(bufs) * self.plan.expert_bytes
            self._peak_staging = max(self._peak_staging, self._staging_bytes)
        return True

    def _run_chunk(self, chunk: Chunk) -> None:
        plan, me = self.plan, self.rank
        if not self._open_chunk(chunk):
            return
        waiting = {l: set(plan.incoming(me, l)) for l in chunk.layers}
        for l in [l for l, s in waiting.items() if not s]:
            self._mark_ready(l)
            del waiting[l]
        for stage in chunk.stages:
            if self._stop:
                return
            done = self._run_stage(chunk, stage)
            self._store.add("progress", 1)
            for l in list(waiting):
                waiting[l] -= done
                if not waiting[l]:
                    self._mark_ready(l)
                    del waiting[l]

    def _mark_ready(self, layer: int) -> None:
        with self._cv:
            if self._stop:
                return
            self._ready.add(layer)
            self._last_progress = time.monotonic()
        self._store.add(_ready_key(layer), 1)

    def _src_tensors(self, t: Transfer) -> list[torch.Tensor]:
        if t.from_staging:
            with self._lock:
                return self._staging[t.src_tid]
        return self._sources[t.tid]

    def _run_stage(self, chunk: Chunk, stage: Stage) -> set[int]:
        """Post this rank's part of one stage and wait for it; returns the tids received here."""
        built = self._build_units(stage.tids)
        if built is None:
            return set()
        units, received = built
        deadline = time.monotonic() + self.timeout_s
        if self._cuda:  # pragma: no cover - GPU only
            self._post_cuda(units, paced=True)
            done = torch.cuda.Event()
            done.record(self._stream)
            deadline = max(deadline, time.monotonic() + self.timeout_s)  # pacing time is not the transfers'
            self._wait_event(done, deadline, f"{stage.kind} stage ({len(units)} transfers)")
        else:  # gloo posts the stage's P2P at once (paced by its bytes), then copies, then waits
            ops = [o for kind, x in units if kind == "p2p" for o in x]
            self._pace(sum(x.numel() * x.element_size() for _, x, *_ in ops))
            works = self._post_gloo(ops)
            for src, dst in [x for kind, x in units if kind == "copy"]:
                self._pace(sum(d.numel() * d.element_size() for d in dst))
                for a, b in zip(src, dst):
                    b.copy_(a)
            self._wait_works(works, deadline)
        with self._lock:
            self._bytes_received += len(received) * self.plan.expert_bytes
            self._last_progress = time.monotonic()
        return received

    def _build_units(self, tids) -> tuple[list, set[int]] | None:
        """This rank's part of `tids`, one unit per transfer in their order: ("copy", (src, dst)), ("pull",
        [(mapped peer tensor, slot, dst), ...]) or ("p2p", [(op, tensor, peer, tag, what), ...]); and the tids
        received here. A unit may read a staging
        buffer an earlier unit fills (a forward), so they are posted in this order."""
        me, plan = self.rank, self.plan
        mine = [plan.transfers[i] for i in tids
                if plan.transfers[i].src_rank == me or plan.transfers[i].dst_rank == me]
        if not mine:
            return None
        with self._lock:
            if self._stop:
                return None
            staging = {t.tid: self._staging[t.tid] for t in mine if t.dst_rank == me}
        units, received = [], set()
        # a non-contiguous source is copied for its send on the side stream, which sends it: on the caller's stream
        # (the decode loop's, or the transfer thread's default one) the send need not wait for that copy
        with self._on_side_stream():
            for t in mine:
                if t.dst_rank == me:
                    received.add(t.tid)
                pull = self._peer is not None and t.kind == "nvlink"
                if t.src_rank == me and t.dst_rank == me:
                    units.append(("copy", (self._src_tensors(t), staging[t.tid])))
                elif pull and t.dst_rank == me:  # the source's old slot, mapped here (its owner posts nothing)
                    j, src = t.src_slot - t.src_rank * self._k, self._peer[(t.src_rank, t.layer)]
                    units.append(("pull", list(zip(src, [j] * len(src), staging[t.tid]))) if self._cuda
                                 else ("copy", ([w[j] for w in src], staging[t.tid])))
                    self._pulled += t.nbytes
                elif pull:
                    continue
                elif t.src_rank == me:
                    units.append(("p2p", [(dist.isend, x if x.is_contiguous() else x.contiguous(), t.dst_rank,
                                           self._tag(t, i), f"send of {t.describe()}")
                                          for i, x in enumerate(self._src_tensors(t))]))
                else:
                    units.append(("p2p", [(dist.irecv, x, t.src_rank, self._tag(t, i), f"recv of {t.describe()}")
                                          for i, x in enumerate(staging[t.tid])]))
        return units, received

    def _wait_works(self, works, deadline: float) -> None:
        """gloo: wait for posted ops until `deadline` (monotonic)."""
        for w, what in works:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what}: not complete after {self.timeout_s:.1f} s")
            try:
                w.wait(timeout=datetime.timedelta(seconds=max(left, 1e-3)))
            except Exception as e:
                raise RuntimeError(f"{what} failed: {e}") from e

    # ---------------------------------------------------------------- boundary mode
    def _launch(self) -> None:
        """Decode thread, once per boundary: post the next batch of the plan's fixed schedule (`boundary_schedule`).

        Every rank walks the same schedule and posts the same batch at the same boundary (only its own ops), and a
        chunk opens only at the boundary after the previous chunk's layers switched (agreed). So every rank
        launches the migration's NCCL kernels at the same point between the model's own: in a real EP-2 server,
        transfers launched from a free-running thread hung both GPUs beside the model's collectives (ranks
        launching the two communicators' kernels in different orders can wait on each other forever). Posting
        never waits: NCCL ops and local copies go onto the side stream, gloo ops wait for the waiter thread, which
        is told (one CUDA event, one notify) only after the batches the schedule flags: those that finish a layer,
        end a chunk, or every FLUSH_EVERY-th, not at every boundary (each notify hands the waiter the GIL)."""
        if self._state != "running" or self._stop:
            return
        c, k = self._cursor
        if c >= len(self.plan.chunks):
            return
        if c not in self._opened:
            if c and not all(l in self._switched for l in self.plan.chunks[c - 1].layers):
                return
            if not self._open_chunk(self.plan.chunks[c]):
                return
            self._opened.add(c)
            with self._cv:  # layers with nothing incoming here are ready at once (the waiter marks them)
                self._launched.append(("open", c, None, time.monotonic()))
                self._cv.notify_all()
        self._cursor = (c + 1, 0) if k + 1 >= len(self._batches[c]) else (c, k + 1)
        built = self._build_units(self._batches[c][k])
        if built is not None:
            units, received = built
            if self._unflushed_t is None:
                self._unflushed_t = time.monotonic()
            if self._cuda:  # pragma: no cover - GPU only
                self._post_cuda(units)
            else:  # gloo: the waiter posts them, in order (no second communicator to interleave with)
                self._unflushed.extend(units)
            self._unflushed_tids |= received
        if self._flush[c][k] and self._unflushed_t is not None:
            handle = self._unflushed
            if self._cuda:  # pragma: no cover - GPU only
                handle = torch.cuda.Event()
                handle.record(self._stream)
            with self._cv:
                self._launched.append(("batch", self._unflushed_tids, handle, self._unflushed_t))
                self._cv.notify_all()
            self._unflushed, self._unflushed_tids, self._unflushed_t = [], set(), None

    def _waiter_main(self) -> None:
        """Boundary mode: wait for each posted batch in order (deadline timeout_s from its posting), mark
        layers ready when all their incoming transfers arrived."""
        try:
            if self._cuda:  # pragma: no cover - GPU only
                torch.cuda.set_device(self._device)
            me, plan = self.rank, self.plan
            waiting = {l: set(plan.incoming(me, l)) for l in plan.layers}
            while True:
                with self._cv:
                    while not self._stop and not self._launched:
                        self._cv.wait(timeout=0.1)
                    if self._stop:
                        return
                    kind, what, handle, posted = self._launched.pop(0)  # what: chunk (open) or tids received
                if kind == "open":
                    for l in self.plan.chunks[what].layers:
                        if not waiting[l]:
                            self._mark_ready(l)
                    continue
                deadline = max(posted, time.monotonic()) + self.timeout_s  # earlier batches waited first
                if isinstance(handle, list):  # gloo: post each unit and wait for it before the next
                    for kind, x in handle:
                        if kind == "copy":
                            for a, b in zip(*x):
                                b.copy_(a)
                            continue
                        self._wait_works(self._post_gloo(x), deadline)
                else:  # pragma: no cover - GPU only
                    self._wait_event(handle, deadline, "posted transfers", stop=lambda: self._stop)
                with self._lock:
                    self._bytes_received += len(what) * plan.expert_bytes
                    self._last_progress = time.monotonic()
                self._store.add("progress", 1)
                for l in {plan.transfers[t].layer for t in what}:
                    waiting[l] -= what
                    if not waiting[l]:
                        self._mark_ready(l)
        except Exception as e:
            self._fail(f"rank {self.rank}: {type(e).__name__}: {e}")

    def _post_cuda(self, units, paced: bool = False) -> None:  # pragma: no cover - GPU only
        """Post units on the side stream, in order (stream order makes a forward wait for the unit filling its
        source): local copies, pulls out of a peer's mapped slot (copy engines), one NCCL group per P2P transfer
        (both ends post a pair's transfers in the same (tid, tensor) order, which is how NCCL matches them).
        `paced`: the transfer thread's, one expert at a time at max_bytes_per_s."""
        with torch.cuda.stream(self._stream):
            for kind, x in units:
                if kind == "copy":
                    if paced:
                        self._pace(sum(d.numel() * d.element_size() for d in x[1]))
                    for a, b in zip(*x):
                        b.copy_(a, non_blocking=True)
                elif kind == "pull":
                    if paced:
                        self._pace(sum(d.numel() * d.element_size() for _, _, d in x))
                    for src, j, dst in x:
                        src.pull(j, dst, self._stream)
                else:
                    if paced:
                        self._pace(sum(t.numel() * t.element_size() for _, t, *_ in x))
                    self._post_nccl(x)

    def _post_gloo(self, ops) -> list:
        """Post (op, tensor, peer, tag, what) ops on gloo; their (work, what) for `_wait_works`."""
        works = []
        for op, x, peer, tag, what in ops:
            kw = {"group_dst": peer} if op is dist.isend else {"group_src": peer}
            works.append((op(x, group=self._group, tag=tag, **kw), what))
        return works

    def _post_nccl(self, ops) -> None:  # pragma: no cover - GPU only
        """One transfer's (op, tensor, peer, tag, what) ops as one NCCL group; the current stream waits for it."""
        p2p = [dist.P2POp(op, x, group=self._group, tag=tag, group_peer=peer) for op, x, peer, tag, _ in ops]
        for w in dist.batch_isend_irecv(p2p):
            w.wait()  # stream-level: the current (side) stream waits for the NCCL stream

    def _wait_event(self, done, deadline: float, what: str, stop=lambda: False) -> None:  # pragma: no cover
        """Poll a CUDA event until `deadline` (monotonic) or until `stop()`; TimeoutError naming `what`. The poll
        backs off from 0.2 to 4 ms: each poll takes the GIL from the decode thread, and being late by a few ms only
        delays a layer's readiness, which is decided in rounds of several passes anyway."""
        delay = 2e-4
        while not done.query():
            if time.monotonic() > deadline or stop():
                raise TimeoutError(f"{what} not complete after {self.timeout_s:.1f} s")
            time.sleep(delay)
            delay = min(2 * delay, 4e-3)

    def _pace(self, nbytes: int) -> None:
        """Wait until `nbytes` more fit the pace (transfer thread only)."""
        if not self._rate:
            return
        now = time.monotonic()
        start = max(self._pace_t, now)
        if start > now:
            time.sleep(start - now)
        self._pace_t = start + nbytes / self._rate

    def _tag(self, t: Transfer, i: int) -> int:
        return self._tag_base + t.tid * self._ntensors + i


LAUNCH_MODES = ("boundary", "thread")  # who posts the transfers (settings' eplb_async_launch names the same)


def pacing(launch: str, expert_bytes: int, transfers_per_boundary: int, copy_gbps: float | None) -> dict:
    """MigrationExecutor's pacing keywords for a launch mode: `transfers_per_boundary` experts per rank and
    boundary ("boundary"), or a background thread at `copy_gbps` GB/s (None or 0: unpaced; "thread")."""
    if launch == "boundary":
        return {"bytes_per_boundary": transfers_per_boundary * expert_bytes}
    if launch == "thread":
        return {"max_bytes_per_s": copy_gbps * 1e9 if copy_gbps else None}
    raise ValueError(f"launch {launch!r}: want one of {', '.join(LAUNCH_MODES)}")


def connect_peers(group, device: torch.device | None = None, nbytes: int = 1 << 20) -> None:
    """Exchange one message with every peer of `group`, the way transfers do (one batch per peer), and wait.

    Call where every rank of the group calls it and no other communicator is busy (process start). NCCL sets
    up P2P lazily: the first send between two ranks builds their connection (and, in PyTorch, may build a
    communicator for the pair) inside `batch_isend_irecv`, blocking the host until the peer joins. Done during
    serving, that setup ran beside the model's own collectives on the other communicator and hung an EP 2
    server on the H200 (both ranks' transfer threads in `batch_isend_irecv`, both GPUs at 100%). Pairs go in
    lexicographic order on every rank: the smallest pending pair always has both ends at it, so none waits
    forever."""
    me, world = dist.get_rank(group), dist.get_world_size(group)
    dev = device if device is not None else torch.device("cpu")
    out = torch.full((nbytes,), me + 1, dtype=torch.uint8, device=dev)
    for a, b in itertools.combinations(range(world), 2):
        if me not in (a, b):
            continue
        peer = b if me == a else a
        got = torch.empty_like(out)
        ops = [dist.P2POp(dist.isend, out, group=group, group_peer=peer),
               dist.P2POp(dist.irecv, got, group=group, group_peer=peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if int(got[0]) != peer + 1 or int(got[-1]) != peer + 1:
            raise RuntimeError(f"rank {me}: warm-up message from rank {peer} arrived wrong")


def slot_digests(weights: Mapping[int, torch.Tensor | Sequence[torch.Tensor]], layers: Sequence[int]) -> np.ndarray:
    """[len(layers), slots] int64: an order-sensitive checksum of each expert slot's bytes, over all of the
    layer's tensors (sum of byte x (position % 251 + 1)). Equal bytes give equal digests on any GPU; a moved
    expert whose digest differs from its digest before the move did not arrive intact. One slot at a time
    (a temporary of 4 bytes per weight byte)."""
    rows = []
    for l in layers:
        ws = [weights[l]] if isinstance(weights[l], torch.Tensor) else list(weights[l])
        k = ws[0].shape[0]
        acc = torch.zeros(k, dtype=torch.int64, device=ws[0].device)
        for w in ws:
            flat = w.contiguous().view(torch.uint8).reshape(k, -1)
            pos = torch.arange(flat.shape[1], device=flat.device, dtype=torch.int32) % 251 + 1
            for j in range(k):
                acc[j] += (flat[j].to(torch.int32) * pos).sum()
        rows.append(acc.cpu().numpy())
    return np.stack(rows) if rows else np.zeros((0, 0), np.int64)


MAX_RUNS = 8  # a switch copies up to this many runs of consecutive slots as slices, else one index_copy_


def _runs(slots: Sequence[int]) -> tuple[tuple[int, int, int], ...]:
    """(first live slot, first staging row, length) of each run of consecutive slots, staging row n
    holding slot slots[n]; () when there are more than MAX_RUNS (then one index_copy_ does it)."""
    runs: list[list[int]] = []
    for n, s in enumerate(slots):
        if runs and s == runs[-1][0] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, n, 1])
            if len(runs) > MAX_RUNS:
                return ()
    return tuple(tuple(r) for r in runs)


def _copy_rows(live: torch.Tensor, block: torch.Tensor, idx: torch.Tensor, runs) -> None:
    """live[slots] = block, as plain slice copies (full copy bandwidth) for a few runs of consecutive
    slots, else as one index_copy_ over the widest integer view of the rows: index_copy_ moves one element
    per thread, so over FP8 bytes it ran at a fraction of the bandwidth (about 20 ms for 11 GB on an H200)."""
    if runs:
        for dst, src, n in runs:
            live[dst:dst + n].copy_(block[src:src + n])
        return
    _wide(live).index_copy_(0, idx, _wide(block))


def _wide(t: torch.Tensor) -> torch.Tensor:
    """The same bytes viewed as the widest integer type that divides a row's last dimension."""
    row_bytes = t.shape[-1] * t.element_size() if t.dim() > 1 else t.element_size()
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        size = torch.empty((), dtype=dtype).element_size()
        if t.dim() > 1 and t.is_contiguous() and row_bytes % size == 0 and t.element_size() <= size:
            return t.view(dtype)
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _round_key(r: int) -> str:
    return f"round/{r}"


def _ready_key(layer: int) -> str:
    return f"ready/{layer}"


def _parse(raw) -> tuple[str, object]:
    s = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
    if s.startswith("A:"):
        return ("abort", s[2:])
    if s.startswith("S:"):
        return ("switch", tuple(int(x) for x in s[2:].split(",") if x))
    raise ValueError(f"unexpected migration decision {s!r}")
