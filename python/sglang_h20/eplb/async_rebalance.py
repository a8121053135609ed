"""eplb_async: SGLang's EPLB rebalance without stalling decode (hooks for SGLang 0.5.17).

Upstream `EPLBManager.rebalance` (a generator driven once per forward pass by
`on_forward_pass_end`) computes the new placement and then runs `ExpertLocationUpdater.update`:
blocking P2P of every layer before the next forward pass. With this switch on it becomes:

forward thread (between passes; never waits on a transfer)
  1. as upstream: skip when rebalancing is disabled; `dump_record("object")` (SGLang's all-reduce,
     in lockstep on every rank; its one-time empty_cache at the first dump is skipped) and
     `_check_rebalance_needed`. The placement thread copies the logical counts to the host (side stream, after an
     event recorded here), so this step adds no device sync and pins no memory.
  2. start a PLACEMENT thread, then `yield` (= let one forward pass run) until the start GATE
     (below) says go. Elastic-EP post-scale rebalances and a world != ep_size stay upstream.
  3. `MigrationExecutor.start()` at the agreed boundary, then `yield; maybe_switch()` until the
     executor is done or aborted. `on_switch(layers)` copies those layers' rows of every routing
     field of the new metadata into the live `ExpertLocationMetadata` (same fields as upstream's
     `update`, but row copies in place: pointers captured by CUDA graphs stay valid, and the cost
     is per switched layer). Weights are swapped in by the executor in the same call, on the
     compute stream, so each forward pass sees per layer either old weights + old maps or new + new.
     With SGLANG_H20_EPLB_ASYNC_LAUNCH=boundary (default) `maybe_switch` also posts the next
     transfers (TUNING.transfers_per_boundary experts per rank), the same ones on every rank; with
     "thread" a transfer thread posts them, paced at TUNING.copy_gbps.
  4. done: `init_lplb_solvers` when ep_dispatch_algorithm == "lp" (as upstream). With
     SGLANG_H20_EPLB_ASYNC_VERIFY=on a thread then checks every slot's bytes against its expert's
     digest from before the move (digests taken by the placement thread, shared through the store).

placement thread (off the critical path)
  `ExpertLocationMetadata.init_by_eplb` with the host counts and a CPU view of server_args, i.e.
  upstream's algorithm as configured (`--eplb-algorithm`; our affinity placement when the eplb
  feature hooks `rebalance_experts`); rows of non-MoE layers are kept; all ranks check through the
  store that they computed the same placement; `plan_migration` (staging budget = layers of local
  slots: `eplb_rebalance_layers_per_chunk`, or TUNING.staging_layers, as upstream's one layer of
  temp buffers); the new metadata's tensors are copied to their devices on a side stream; an
  executor is built (its transfer thread later runs on its own CUDA stream). All of it runs in
  short bursts with sleeps between (`throttle`: pace points in the loops, SGLang's placement one
  layer per call): a busy Python thread beside the decode thread slows each of the decode thread's
  torch ops (GIL hand-offs), a sleeping one does not. (Not a profile hook: on CPython 3.12 one
  slows every thread's Python.)

start gate (same round protocol as the executor's switches)
  Every rank must call `start()` at the same boundary. Rounds end at boundaries
  (r + 1) * switch_every counted from the rebalance start; round r's decision is the first value
  written to store key ``round/<r>`` by `compare_set` ("G" go, "W" wait, "A:<why>" abort). A
  placement thread proposes "G" for a round its decode loop has not reached minus decide_ahead,
  once every rank added 1 to ``ready`` (plan and executor built); a rank whose decode loop reaches
  a round boundary without knowing the decision writes "W" itself (one store round trip, the only
  store access of the decode thread). Hence every rank starts at the same boundary.

Failures: a placement error, ranks disagreeing on the placement, or not all ranks ready within
TUNING.placement_timeout_s make the gate abort (every rank, same boundary, one ERROR line each);
transfer failures, timeouts and dead peers are handled by the executor (abort at the same
boundary on every survivor, one ERROR line). Layers not switched keep the old weights and maps;
after an executor abort the migration process group is re-created at the next rebalance. If SGLang
drops the generator (`reset_generator`, e.g. disable_rebalance), the migration is closed locally;
peers then abort through their watchdog.

Hook targets: `EPLBManager.__init__` (AFTER: create the dedicated migration process group, eagerly
initialised with its P2P connections, at startup rather than in the serving loop), `EPLBManager.rebalance`
(AROUND), `EPLBManager.on_forward_pass_end` (AFTER: one timestamp per pass, so each rebalance logs the
wall time between passes it spanned against the passes before it: "pass intervals ... p99 ratio") and
`ModelRunner.forward` (BEFORE: whether the pass decodes, for the same line over decode passes only); with peer
copies also `ModelRunner.initialize` (AFTER: map the node's expert tensors once the model is loaded, `map_peers`).
Trigger options stay upstream: `eplb_rebalance_num_iterations` (the `_entrypoint` loop calls our
rebalance), `eplb_min_rebalancing_utilization_threshold`, disable/enable_rebalance.

Tested on CPU with gloo (test/cpu/test_eplb_migration_async.py). In real EP-2 servers on two H200s
(benchmark/results/eplb/README.md): transfers posted by a background thread (launch "thread") hung 3 of 4
servers, with both ranks' transfer threads inside the migration group's `batch_isend_irecv` beside the model's
collectives, also with the P2P connections built at startup; posted by the decode loop ("boundary", the
default) none of 4 hung, and two full re-placements (768 slots, 31 GB over NVLink) completed with every slot
bit-identical (SGLANG_H20_EPLB_ASYNC_VERIFY). One mostly local re-placement left 4 of 384 slots wrong on one
rank: a staging race, since fixed: staging is one pool made with the executor, and a chunk's writes wait on an
event after the previous switch's copies (`MigrationExecutor._open_chunk`, test/gpu/test_eplb_migration_gpu.py).
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import pathlib
import threading
import time
import zlib

import numpy as np
import torch
import torch.distributed as dist

from sglang_h20.abstats import nearest_rank
from sglang_h20.eplb import throttle
from sglang_h20.eplb.integration import RUNNER_INIT_TARGET, eplb_off_check
from sglang_h20.eplb.migration import MigrationExecutor, connect_peers, pacing, slot_digests
from sglang_h20.eplb.migration_plan import group_free, plan_migration
from sglang_h20.eplb.peer_copies import share_weights
from sglang_h20.eplb.placement import Placement, Topology
from sglang_h20.features import Hook
from sglang_h20.logonce import OnceLog
from sglang_h20.settings import Settings

log = logging.getLogger("sglang_h20.eplb.async")
_note = OnceLog(log, "eplb_async: ")

MANAGER = "sglang.srt.eplb.eplb_manager.EPLBManager"
INIT_TARGET = MANAGER + ".__init__"
REBALANCE_TARGET = MANAGER + ".rebalance"
PASS_TARGET = MANAGER + ".on_forward_pass_end"
FORWARD_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"

# ExpertLocationMetadata fields that route tokens (the list upstream's `update` copies), dim 0 = layer
ROUTING_FIELDS = ("physical_to_logical_map", "physical_to_logical_map_cpu",
                  "logical_to_all_physical_map", "logical_to_all_physical_map_cpu",
                  "logical_to_all_physical_map_num_valid", "logical_to_rank_dispatch_physical_map")


@dataclasses.dataclass
class Tuning:
    switch_every: int = 4             # decision rounds every N forward passes
    decide_ahead: int = 2             # decided N passes before the round's boundary
    timeout_s: float = 60.0           # per transfer stage (the executor's deadline)
    placement_timeout_s: float = 300.0  # every rank must have its plan within this
    staging_layers: int = 1           # staging budget, in layers of this rank's slots
    placement_burst_s: float = 2e-4   # the placement thread holds the GIL at most about this long at a time, then
    placement_pause_s: float = 1e-3   # sleeps this long (`throttle.bursts`, pace points in its loops). Unthrottled,
    #                                   its ~45 ms of Python made the decode passes beside it 13-20 ms (3.4 steady) in
    #                                   an EP-2 server: every torch op of the decode thread releases the GIL and waits
    #                                   to get it back (eplb/async_attribution_2_ep2_h200.json). A lower switch
    #                                   interval did not help (1e-4 there; 2e-5 on a CPU stand-in); bursts did
    copy_gbps: float | None = 10.0    # pace of the side-stream copies (GB/s; None: unpaced): decode is
    #                                   HBM-bound, and an unpaced copy takes its bandwidth from the steps.
    #                                   10 GB/s (~0.2% of an H200's HBM) still moves one EP16 GPU's 46 GB
    #                                   of experts in ~5 s; a placement is not worth more per second sooner
    transfers_per_boundary: int = 1   # launch "boundary": experts each rank sends (and receives) per pass boundary
    #                                   (one DeepSeek-V3 expert is 44 MB: ~11 GB/s at a 4 ms step)
    nccl_max_ctas: int | None = 4     # SMs the migration group's NCCL kernels may take while decode runs beside
    #                                   them (None: NCCL's choice); a P2P of one 44 MB expert still takes < 1 ms on
    #                                   NVLink with 4 CTAs, inside the one pass it has. Not yet measured either way
    steady_passes: int = 512          # pass intervals kept as the steady reference before a rebalance
    idle_gap_s: float = 1.0           # a longer interval between passes is an idle server, not a step


TUNING = Tuning()


@dataclasses.dataclass(frozen=True)
class Mode:
    """How the switches set up this feature (settings eplb_async_launch / _verify / _shuffle / _peer)."""
    launch: str = "boundary"  # who posts the transfers: "boundary" (the decode loop) or "thread"
    verify: bool = False      # check every slot's bytes after the move (`_Job.check_moved`)
    shuffle: bool = False     # benchmarks: move to a seeded permutation of SGLang's placement (`shuffled`)
    peer: bool = False        # NVLink transfers pulled over CUDA IPC (`share_weights`); a one-node plan is then posted
    #                           by the transfer thread (`mover`). Posted by the decode loop it took that thread's work
    #                           per boundary from 280-407 to 155-210 us in EP-2 servers, but decode p99 during full
    #                           re-placements rose (pooled 1.32 vs NCCL's 1.09, one run:
    #                           eplb/async_shuffle_4_peer_ep2_h200.json). Posted by the transfer thread: 15-29 us per
    #                           boundary, migration phase at steady p99, whole rebalance 0.955 vs NCCL's 0.931 pooled
    #                           (eplb/async_mover_1_ep2_h200.json, 2 vs 1 servers): off until an A/B says which wins
    layered: bool = True      # SGLang's deepseek placement one layer per call, pace points between (`place_layered`);
    #                           off while our affinity placement (eplb switch) replaces the algorithm: all layers


EXECUTOR = MigrationExecutor  # tests substitute a failing executor


def mover(launch: str, peer: bool, plan) -> str:
    """Who posts a rebalance's transfers: the configured launch mode, except that a plan which with peer copies
    needs no process group (`group_free`: one node) is posted by the transfer thread, paced at TUNING.copy_gbps:
    copy-engine pulls cannot deadlock against the model's collectives, and the decode thread is left only the
    switches (posting one expert per boundary there took it 155-210 us for pulls, 280-407 us for NCCL P2P, per pass,
    eplb/async_shuffle_4_peer_ep2_h200.json)."""
    return "thread" if peer and group_free(plan) else launch


class _OnCpu:
    """server_args as seen by init_by_eplb in the placement thread: everything on the host."""

    device = "cpu"

    def __init__(self, server_args):
        self._sa = server_args

    def __getattr__(self, name):
        return getattr(self._sa, name)


class _State:
    """Per-EPLBManager state (attribute `_h20_async`)."""

    def __init__(self):
        # (wall time, decode pass?) of each pass end; decode? is None where the forward hook did not see the pass
        self.pass_ends: collections.deque = collections.deque(maxlen=TUNING.steady_passes + 1)
        self.during: list[tuple] | None = None  # while a rebalance runs: every boundary since its start
        self.decode: bool | None = None  # the pass now running is a decode pass (before_forward)
        self.group = None
        self.dead_groups = []  # groups given up after an abort: never destroyed on the decode thread
        self.seq = 0
        self.history: list[dict] = []   # one entry per rebalance: outcome, steps, error
        self.warned: set[str] = set()
        self.peers = ...  # peer copies: the node's expert tensors mapped here (`share_weights`; None: not possible)


def _state(manager) -> _State:
    st = getattr(manager, "_h20_async", None)
    if st is None:
        st = manager._h20_async = _State()
    return st


def history(manager) -> list[dict]:
    """What each asynchronous rebalance of this manager ended with (tests, logs)."""
    return _state(manager).history


def nccl_options():
    """The migration group's NCCL options: at most TUNING.nccl_max_ctas CTAs per kernel; None (NCCL's defaults)
    when unset or when this torch has no such option."""
    if TUNING.nccl_max_ctas is None:
        return None
    try:
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.max_ctas = int(TUNING.nccl_max_ctas)
        return opts
    except (AttributeError, TypeError) as e:
        log.warning("eplb_async: NCCL options unavailable (%s); the migration group uses NCCL's defaults", e)
        return None


def _new_group():
    """A process group only the migration uses, initialised now (NCCL: first op needs all ranks), with its
    P2P connections built too (`connect_peers`): NCCL's lazy setup during serving hung an EP 2 server."""
    cuda = torch.cuda.is_available() and "nccl" in str(dist.get_backend())
    g = dist.new_group(backend="nccl", pg_options=nccl_options()) if cuda else dist.new_group(backend="gloo")
    dev = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    x = torch.zeros(1, device=dev)
    dist.all_reduce(x, group=g)
    connect_peers(g, dev)
    return g


def before_forward(model_runner, forward_batch, *args, **kwargs):
    """BEFORE ModelRunner.forward: whether the pass is a decode pass, so that the pass clock can judge decode steps
    apart from prefill passes (in a serving bench those are the p99 of all passes: ~40 ms against ~4.5). Under DP
    attention a rank's decode pass waits in the MoE for a rank that extends; SGLang's `is_extend_in_batch` (any rank
    extends, from its MLP sync) makes that pass a prefill pass here too."""
    manager = getattr(model_runner, "eplb_manager", None)
    if manager is not None:
        mode = getattr(forward_batch, "forward_mode", None)
        _state(manager).decode = (bool(mode.is_decode()) and not getattr(forward_batch, "is_extend_in_batch", False)
                                  if mode is not None else None)
    return None


def after_pass(_result, manager, *args, **kwargs):
    """AFTER EPLBManager.on_forward_pass_end: the wall time of every pass boundary on this rank (and whether the
    pass was a decode pass), so a rebalance can compare the passes it spans with the ones before it
    (`pass_intervals`). One perf_counter per pass."""
    st = _state(manager)
    end = (time.perf_counter(), st.decode)
    st.decode = None
    st.pass_ends.append(end)
    if st.during is not None:
        st.during.append(end)
    return None


def pass_intervals(ends, decode_only: bool = False, after_decode: bool = False) -> list[float]:
    """Milliseconds between consecutive boundaries ((time, decode?) pairs), idle gaps (no pass for
    TUNING.idle_gap_s) left out; `decode_only`: the intervals that end with a decode pass; `after_decode`: only
    those whose previous pass decoded too (a decode pass right after a prefill pass carries part of that prefill:
    in EP-2 servers 22 of the 32 decode passes over 9 ms during moves were such passes, at ~4% of all passes)."""
    ends = list(ends)
    gaps = [(1e3 * (b[0] - a[0]), b[1], a[1]) for a, b in zip(ends, ends[1:])]
    return [g for g, decode, prev in gaps if g <= 1e3 * TUNING.idle_gap_s and (decode or not decode_only)
            and (prev or not after_decode)]


def interval_summary(ms: list[float]) -> dict:
    """p50 / p99 / max of pass intervals (nearest rank), and their count."""
    if not ms:
        return {"n": 0}
    return {"n": len(ms), "p50_ms": nearest_rank(ms, 0.50), "p99_ms": nearest_rank(ms, 0.99), "max_ms": max(ms)}


def log_pass_intervals(mid: str, during: dict, before: dict, kind: str = "pass") -> None:
    """The lines benchmark/serving/affinity_remote_share.py reads: passes (kind "pass": all; "decode pass": decode
    passes only) during a rebalance against the ones before."""
    log.info("eplb_async: rebalance %s %s intervals: during p50 %.2f p99 %.2f max %.2f ms (%d), "
             "before p50 %.2f p99 %.2f max %.2f ms (%d); p99 ratio %.3f", mid, kind, during["p50_ms"],
             during["p99_ms"], during["max_ms"], during["n"], before["p50_ms"], before["p99_ms"],
             before["max_ms"], before["n"], during["p99_ms"] / before["p99_ms"])


def rebalance_intervals(spanned, before) -> dict[str, list[float]]:
    """A rebalance's pass intervals (ms), keyed `<all|decode|decode_after_decode>_<during|before>`: every pass,
    decode passes only, and decode passes whose previous pass decoded too, over the passes it spanned and the
    steady ones before it."""
    kinds = {"all": {}, "decode": {"decode_only": True},
             "decode_after_decode": {"decode_only": True, "after_decode": True}}
    return {f"{kind}_{when}": pass_intervals(ends, **kw)
            for kind, kw in kinds.items() for when, ends in (("during", spanned), ("before", before))}


def rebalance_passes(spanned, work: list[float], gate_steps: int, switch_at: set[int],
                     t_ref: float) -> dict[str, list]:
    """Each pass a rebalance spanned, in order (unfiltered): its interval in ms (boundary to boundary, our boundary
    work included), its end in ms after `t_ref` (the job's creation: lines it up with the placement thread's
    steps), whether it decoded, its phase ("placement" while the new placement is computed,
    "start" for the pass whose boundary started the migration, then "migration"), our boundary work in µs and
    whether layers switched at its boundary; so that slow passes can be told apart by what ran beside them."""
    n = len(spanned) - 1
    return {"ms": [round(1e3 * (b[0] - a[0]), 3) for a, b in zip(spanned, spanned[1:])],
            "end_ms": [round(1e3 * (b[0] - t_ref), 3) for b in spanned[1:]],
            "decode": [bool(b[1]) for b in spanned[1:]],
            "phase": ["placement" if k < gate_steps - 1 else "start" if k == gate_steps - 1 else "migration"
                      for k in range(n)],
            "work_us": [round(1e6 * w, 1) for w in work[:n]],
            "switch": [k in switch_at for k in range(n)]}


def dump_intervals(out_dir: str, mid: str, intervals: dict[str, list[float]], passes: dict | None = None) -> None:
    """A rebalance's raw pass intervals (`rebalance_intervals`) and, when given, its passes one by one
    (`rebalance_passes`) as `eplb_async_<id>_rank<r>.json` in the benchmark's dump folder (SGLANG_H20_OBSERVE_DIR),
    for a p99 ratio pooled over ranks with a confidence interval: one rank's window of ~400 passes cannot tell
    1.05 from 1.3."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    rec = {"id": mid, "rank": rank, **intervals, **({"passes": passes} if passes is not None else {})}
    try:
        path = pathlib.Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        final = path / f"eplb_async_{mid}_rank{rank}.json"
        tmp = final.with_name(final.name + ".tmp")
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, final)  # readers poll for the file: never let them see it half written
    except OSError as e:
        log.warning("eplb_async: pass intervals of %s not written to %s: %s", mid, out_dir, e)


def _share(st: _State, rank: int, topo: Topology, weights, moe) -> None:
    """st.peers = the node's expert tensors mapped here (`share_weights`, collective over the ranks; None where any
    rank cannot map)."""
    store = dist.PrefixStore("sglang_h20/eplb_peers/", dist.distributed_c10d._get_default_store())
    st.peers = share_weights(store, rank, topo, {l: list(weights[l]) for l in moe}, TUNING.placement_timeout_s)
    log.info("eplb_async: peer copies %s", "on: NVLink transfers pulled over CUDA IPC"
             if st.peers is not None else "off: every transfer through the migration group")


def _topology(manager, world: int, meta) -> Topology:
    """The EP world as the migration plans it: nodes from server_args.nnodes, the metadata's slots per GPU."""
    nnodes = int(getattr(manager._server_args, "nnodes", 1) or 1)
    return Topology(nnodes, world // nnodes, meta.num_local_physical_experts)


def map_peers(manager) -> None:
    """Peer copies: map the node's expert tensors now, once the model is loaded (startup, every rank), not in the
    first rebalance's placement thread: there the mapping (56 ms, CUDA IPC opens) slowed the decode passes beside it
    to 17-23 ms in EP-2 servers (eplb/async_mover_1_ep2_h200.json). A failure leaves it to that rebalance."""
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    st = _state(manager)
    if st.peers is not ... or not dist.is_initialized():
        return
    try:
        meta = get_global_expert_location_metadata()
        weights = manager._get_model().routed_experts_weights_of_layer
        _share(st, dist.get_rank(st.group), _topology(manager, dist.get_world_size(st.group), meta), weights,
               sorted(int(l) for l in weights))
    except Exception as e:  # the first rebalance maps them instead (or falls back to NCCL, one line)
        st.peers = ...
        log.warning("eplb_async: peer copies not mapped at startup (%s: %s); the first rebalance tries",
                    type(e).__name__, e)


def after_model_init(_result, runner, *args, **kwargs):
    """AFTER ModelRunner.initialize (the model loaded; on every rank, drafts without EPLB aside): `map_peers`."""
    manager = getattr(runner, "eplb_manager", None)
    if manager is not None:
        map_peers(manager)
    return None


def after_init(_result, manager, *args, **kwargs):
    """AFTER EPLBManager.__init__: the migration group, created at startup on every rank."""
    try:
        if dist.is_initialized():
            _state(manager).group = _new_group()
    except Exception as e:  # rebalance then retries, or falls back upstream
        log.warning("eplb_async: migration group not created at startup: %s: %s", type(e).__name__, e)
    return None


# ----------------------------------------------------------------------------- start gate
def _decode(raw) -> tuple[str, str]:
    s = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
    return {"G": "go", "W": "wait", "A": "abort"}[s[0]], s[2:]


class _Gate:
    """Agree on the boundary at which every rank starts the migration (or gives up)."""

    def __init__(self, store, world: int, every: int, ahead: int):
        self.store, self.world, self.every, self.ahead = store, world, every, ahead
        self.cv = threading.Condition()
        self.boundary = 0
        self.next_round = 0
        self.decisions: dict[int, tuple[str, str]] = {}

    def step(self):
        """Decode thread, once per boundary: the decision of the round ending here, else None."""
        with self.cv:
            self.boundary += 1
            b, r = self.boundary, self.next_round
            self.cv.notify_all()
            if b < (r + 1) * self.every:
                return None
            dec = self.decisions.get(r)
        if dec is None:
            try:
                dec = _decode(self.store.compare_set(f"round/{r}", "", "W:"))
            except Exception as e:
                dec = ("abort", f"store unreachable: {e}")
        with self.cv:
            dec = self.decisions.setdefault(r, dec)
            self.next_round = r + 1
        return dec

    def propose(self, value: str, stop: threading.Event) -> None:
        """Placement thread: write `value` for the next round still ahead, until one is not "wait"."""
        r = 0
        while not stop.is_set():
            with self.cv:
                r = max(r, self.next_round)
                while r in self.decisions:
                    if self.decisions[r][0] != "wait":
                        return
                    r += 1
                if self.boundary > (r + 1) * self.every - self.ahead:
                    r += 1  # too close to that round's boundary: the decode thread settles it
                    continue
            dec = _decode(self.store.compare_set(f"round/{r}", "", value))
            with self.cv:
                dec = self.decisions.setdefault(r, dec)
            if dec[0] != "wait":
                return
            r += 1


# ----------------------------------------------------------------------------- placement thread
def _to_host(counts, ready):
    """Placement thread: the dump's logical counts on the host. A CUDA tensor is read on a side stream once the
    decode stream passed `ready`, into pageable memory: this thread waits; the decode thread neither syncs nor
    pins memory (a first pinned allocation stalled another thread's loop step by ~6 ms on an H200:
    benchmark/eplb/placement_interference.py)."""
    if not (isinstance(counts, torch.Tensor) and counts.is_cuda):
        return counts
    side = torch.cuda.Stream(counts.device)
    side.wait_event(ready)
    with torch.cuda.stream(side):
        return counts.to("cpu")


def _skip_first_dump_empty_cache(recorder) -> None:
    """SGLang's stat accumulator empties the CUDA cache at its first dump (`_first_dump`): every cached block is
    freed (a device sync) and the decode passes after it allocate theirs again, while our placement runs. Its
    blocking update then allocates temp buffers; our staging is allocated by the placement thread, and PyTorch's
    allocator frees cached blocks itself before it reports out of memory. So an asynchronous rebalance's first
    dump skips it (one INFO line)."""
    acc = getattr(recorder, "_accumulator", None)
    if getattr(acc, "_first_dump", None) is True:
        acc._first_dump = False
        log.info("eplb_async: the first EPLB dump keeps the CUDA cache (upstream empties it there, which stalls "
                 "the next decode passes)")


def shuffled(meta, layers, mid: str):
    """Benchmarks of the migration only (SGLANG_H20_EPLB_ASYNC_SHUFFLE): `meta` (SGLang's new placement) with the
    slots of each of `layers` permuted by a seed from the rebalance id and the layer, the same on every rank, its
    other routing fields derived again by SGLang's `_init_raw`. Every rebalance then moves nearly every slot, so one
    server times several full re-placements; expert counts per slot are kept, balance per GPU is not."""
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata
    from sglang_h20.eplb.integration import sglang_maps

    p2l = meta.physical_to_logical_map_cpu.clone()
    for l in layers:
        perm = np.random.default_rng([zlib.crc32(mid.encode()), l]).permutation(p2l.shape[1])
        p2l[l] = p2l[l][torch.from_numpy(perm)]
    p2l, log2phy, _ = sglang_maps(p2l.numpy(), meta.num_logical_experts)
    return ExpertLocationMetadata._init_raw(ep_size=meta.ep_size, physical_to_logical_map=p2l,
                                            logical_to_all_physical_map=log2phy)


def _layer_by_layer(server_args) -> bool:
    """SGLang's deepseek algorithms place every layer on its own (its other algorithms: not assumed)."""
    return server_args.eplb_algorithm in ("auto", "deepseek", "deepseek_hierarchical")


def place_layered(server_args, model_config, logical_count):
    """`ExpertLocationMetadata.init_by_eplb`'s result, computed one MoE layer at a time with a pace point between
    (`throttle`): the deepseek algorithm holds the GIL ~1 ms per layer (76 ms for 61 layers x 16 GPUs on one
    CPU core here), and a pace point can only fall between calls. Same glue as upstream's init_by_eplb; the
    routing fields are derived once from the stacked layers (test: equal to upstream's on every field)."""
    from sglang.srt.eplb import eplb_algorithms
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata
    from sglang.srt.runtime_context import get_parallel

    count = torch.as_tensor(logical_count)
    count = count.unsqueeze(0) if count.dim() == 2 else count
    common = ExpertLocationMetadata._init_common(server_args, model_config)
    if common is None:
        return None
    cfg, phys, ep = common["model_config_for_expert_location"], common["num_physical_experts"], common["ep_size"]
    nodes = get_parallel().nnodes
    algorithm = eplb_algorithms.compute_algorithm(raw_algorithm=server_args.eplb_algorithm,
                                                  num_groups=cfg.num_groups, num_nodes=nodes)
    p2l, log2phy = [], []
    for layer in range(count.shape[1]):
        throttle.point()
        p, m, _ = eplb_algorithms.rebalance_experts(
            tokens_per_expert=count[:, layer:layer + 1], num_physical_experts=phys,
            num_local_physical_experts=phys // ep, num_groups=cfg.num_groups, num_nodes=nodes, algorithm=algorithm)
        p2l.append(p)
        log2phy.append(m)
    width = max(m.shape[-1] for m in log2phy)  # replicas listed per expert (-1 padded), as the algorithm gives them
    log2phy = [torch.nn.functional.pad(m, (0, width - m.shape[-1]), value=-1) for m in log2phy]
    return ExpertLocationMetadata._init_raw(ep_size=ep, physical_to_logical_map=torch.cat(p2l),
                                            logical_to_all_physical_map=torch.cat(log2phy))


class _Job:
    """Placement, plan and executor for one rebalance, built off the decode thread."""

    def __init__(self, manager, group, counts, counts_ready, mid: str, mode: Mode, state: _State):
        from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

        self.manager, self.group, self.mid, self.mode = manager, group, mid, mode
        self.state = state  # the manager's: what outlives one rebalance (the peer mappings)
        self.expected = None  # verify: [MoE layers, local slots] digest each slot must have after the move
        self.counts, self.counts_ready = counts, counts_ready
        self.meta = get_global_expert_location_metadata()
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.store = dist.PrefixStore(f"sglang_h20/eplb_async/{mid}/",
                                      dist.distributed_c10d._get_default_store())
        self.gate = _Gate(self.store, self.world, TUNING.switch_every, TUNING.decide_ahead)
        self.stop = threading.Event()
        self.plan = self.fields = self.executor = None
        self.launch = mode.launch  # who posts this rebalance's transfers (`mover`)
        self.t0 = time.perf_counter()
        self.steps: list[tuple[str, float, float]] = []  # placement thread: (step, start ms, end ms) from t0
        self.thread = threading.Thread(target=self._main, name=f"eplb-async-placement-{mid}", daemon=True)

    def _main(self) -> None:
        try:
            with throttle.bursts(TUNING.placement_burst_s, TUNING.placement_pause_s):
                self._build()
                if self.mode.verify:  # before counting ready: a peer reading it then finds it
                    self.store.set(f"digest/{self.rank}", self._digests().tobytes())
        except Exception as e:
            self.gate.propose(f"A:rank {self.rank}: placement failed: {type(e).__name__}: {e}", self.stop)
            return
        self.store.add("ready", 1)
        deadline = time.monotonic() + TUNING.placement_timeout_s
        while not self.stop.is_set() and int(self.store.add("ready", 0)) < self.world:
            if time.monotonic() > deadline:
                self.gate.propose(f"A:rank {self.rank}: not every rank had its plan after "
                                  f"{TUNING.placement_timeout_s:.0f} s", self.stop)
                return
            time.sleep(0.005)
        if self.stop.is_set():  # the rebalance ended (a peer's abort): no peer digests to read, no proposal
            return
        if self.mode.verify:
            try:
                self.expected = self._expected_digests()
            except Exception as e:
                self.gate.propose(f"A:rank {self.rank}: verify setup failed: {type(e).__name__}: {e}", self.stop)
                return
        self.gate.propose("G:", self.stop)

    def _digests(self) -> np.ndarray:
        """This rank's slot digests of every MoE layer, read on a side stream (decode goes on)."""
        w = next(iter(self.weights[self.moe[0]]))
        if w.is_cuda:
            torch.cuda.set_device(w.device)
            side = torch.cuda.Stream(w.device)
            side.wait_stream(torch.cuda.current_stream(w.device))
            with torch.cuda.stream(side):
                return slot_digests(self.weights, self.moe)
        return slot_digests(self.weights, self.moe)

    def _expected_digests(self) -> np.ndarray:
        """Every rank published its digests before it counted itself ready: the expert digests of the old
        placement, then the one each of this rank's slots must show under the new placement."""
        k = self.meta.num_local_physical_experts
        by_rank = [np.frombuffer(self.store.get(f"digest/{r}"), dtype=np.int64).reshape(len(self.moe), k)
                   for r in range(self.world)]
        of_expert = [{int(self.old[l, r * k + j]): by_rank[r][i, j] for r in range(self.world) for j in range(k)}
                     for i, l in enumerate(self.moe)]
        return np.array([[of_expert[i][int(self.p2l[l, self.rank * k + j])] for j in range(k)]
                         for i, l in enumerate(self.moe)], dtype=np.int64)

    def check_moved(self, rec: dict, ready_event) -> None:
        """Verify thread, after the last switch: every slot's digest against its expert's before the move."""
        try:
            if ready_event is not None:
                ready_event.synchronize()
            got = self._digests()
            bad = np.argwhere(got != self.expected)
            k = got.shape[1]
            first = [f"layer {self.moe[i]} slot {self.rank * k + j}" for i, j in bad[:3]]
            rec["verify"] = {"slots": int(got.size), "layers": len(self.moe), "mismatched": int(len(bad)),
                             "first": first}
            if len(bad):
                log.error("eplb_async: rebalance %s verify: %d of %d slots differ from their expert before the "
                          "move (%s)", self.mid, len(bad), got.size, ", ".join(first))
            else:
                log.info("eplb_async: rebalance %s verify: %d slots of %d layers bit-identical to their expert "
                         "before the move", self.mid, got.size, len(self.moe))
        except Exception as e:
            rec["verify"] = {"error": f"{type(e).__name__}: {e}"}
            log.error("eplb_async: rebalance %s verify failed: %s: %s", self.mid, type(e).__name__, e)

    def _build(self) -> None:
        from sglang.srt.eplb.expert_location import ExpertLocationMetadata

        m, cur = self.manager, self.meta
        if cur.physical_to_logical_map.is_cuda:  # this thread's CUDA work goes to the model's GPU
            torch.cuda.set_device(cur.physical_to_logical_map.device)
        counts = _to_host(self.counts, self.counts_ready)
        self._step("counts")
        args = _OnCpu(m._server_args)
        new = place_layered(args, m._model_config, counts) if self.mode.layered and _layer_by_layer(args) \
            else ExpertLocationMetadata.init_by_eplb(args, m._model_config, counts)
        self._step("init_by_eplb")
        weights = m._get_model().routed_experts_weights_of_layer
        moe = sorted(int(l) for l in weights)
        if self.mode.shuffle:
            new = shuffled(new, moe, self.mid)
        old = cur.physical_to_logical_map_cpu.numpy().astype(np.int64)
        p2l = new.physical_to_logical_map_cpu.numpy().astype(np.int64)
        keep = np.ones(old.shape[0], dtype=bool)
        keep[moe] = False
        p2l[keep] = old[keep]
        self.weights, self.moe, self.old, self.p2l = weights, moe, old, p2l
        digest = str(zlib.crc32(p2l.tobytes()))
        agreed = self.store.compare_set("placement", "", digest)
        agreed = agreed.decode() if isinstance(agreed, bytes) else str(agreed)
        if agreed != digest:
            raise RuntimeError("ranks computed different placements (crc32 %s vs %s)" % (digest, agreed))
        self._step("agree")
        topo = _topology(m, self.world, cur)
        E = cur.num_logical_experts
        expert_bytes = sum(t[0].numel() * t.element_size() for t in weights[moe[0]])
        layers_per_chunk = getattr(m._server_args, "eplb_rebalance_layers_per_chunk", None)
        budget = (layers_per_chunk or TUNING.staging_layers) * topo.slots_per_gpu * expert_bytes
        self.plan = plan_migration(Placement(old, topo, E), Placement(p2l, topo, E, "sglang"),
                                   expert_bytes, budget)
        self._step("plan")
        self.fields = self._to_devices(new)
        self._step("to_devices")
        peers = self._peers(topo, weights, moe) if self.mode.peer else None
        self.launch = mover(self.mode.launch, peers is not None, self.plan)
        self.executor = EXECUTOR(
            self.rank, self.world, topo, {l: weights[l] for l in self.plan.layers}, self.plan,
            group=self.group, timeout_s=TUNING.timeout_s, switch_every=TUNING.switch_every,
            decide_ahead=TUNING.decide_ahead, migration_id=self.mid, on_switch=self.switch_rows,
            peer_weights=peers,
            **pacing(self.launch, expert_bytes, TUNING.transfers_per_boundary, TUNING.copy_gbps))
        self._step("executor")

    def _peers(self, topo, weights, moe):
        """The node's expert tensors mapped here for peer copies: at startup (`map_peers`), else at this server's
        first rebalance (every rank takes part; no rank has posted a transfer yet); None where not possible."""
        if self.state.peers is ...:
            _share(self.state, self.rank, topo, weights, moe)
            self._step("share_weights")
        return self.state.peers

    def _step(self, name: str) -> None:
        """Placement thread: `name` ended now; its (start, end) in ms from the job's creation (`steps`), to line
        up with the pass ends of the rebalance's dump."""
        now = 1e3 * (time.perf_counter() - self.t0)
        start = self.steps[-1][2] if self.steps else 0.0
        self.steps.append((name, round(start, 3), round(now, 3)))

    def _to_devices(self, new) -> dict[str, torch.Tensor]:
        """The new metadata's routing fields, each on its live field's device (side stream)."""
        out, side = {}, None
        for f in ROUTING_FIELDS:
            live, src = getattr(self.meta, f), getattr(new, f)
            if live is None or src is None:
                if (live is None) != (src is None):
                    raise RuntimeError(f"metadata field {f} present in only one of old/new")
                continue
            if live.shape != src.shape:
                raise RuntimeError(f"metadata field {f}: shape {tuple(src.shape)} != live {tuple(live.shape)}")
            if live.device.type == "cuda":
                # from pageable memory: this thread waits, nothing pinned (a first cudaHostAlloc stalled another
                # thread's step)
                side = side or torch.cuda.Stream(live.device)
                with torch.cuda.stream(side):
                    out[f] = src.to(live.dtype).to(live.device)
            else:
                out[f] = src.to(live.dtype).clone()
        if side is not None:
            side.synchronize()
        return out

    def switch_rows(self, layers) -> None:
        """Decode thread, between passes: the new routing rows of `layers`, copied in place."""
        stream = None
        for f, src in self.fields.items():
            live = getattr(self.meta, f)
            if live.device.type == "cuda":
                stream = stream or torch.cuda.current_stream(live.device)
                src.record_stream(stream)
            for l in layers:
                live[l].copy_(src[l], non_blocking=live.device.type == "cuda")


# ----------------------------------------------------------------------------- the hook
def make_around_rebalance(mode: Mode):
    """AROUND EPLBManager.rebalance: the same generator contract, an asynchronous migration set up by `mode`."""
    def around_rebalance(original, manager, *args, **kwargs):
        return _rebalance(original, manager, mode, *args, **kwargs)
    return around_rebalance


def _upstream_reason(manager) -> str | None:
    from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    if manager._rebalance_disabled_reason is not None:
        return "disabled"  # upstream logs and returns
    es = ElasticEPStateManager.instance()
    if es is not None and es.has_scaled:
        return "elastic-EP post-scale rebalance"
    if not dist.is_initialized():
        return "torch.distributed is not initialised"
    meta = get_global_expert_location_metadata()
    if meta is None or meta.ep_size != dist.get_world_size():
        return f"ep_size {getattr(meta, 'ep_size', None)} != world size {dist.get_world_size()}"
    if meta.ep_size % (getattr(manager._server_args, "nnodes", 1) or 1):
        return "ep_size not divisible by nnodes"
    return None


def _rebalance(original, manager, mode: Mode, *args, **kwargs):
    st = _state(manager)
    why = _upstream_reason(manager)
    if why is not None:
        if why != "disabled" and why not in st.warned:
            st.warned.add(why)
            log.warning("eplb_async: %s: this rebalance runs upstream (blocking)", why)
        yield from original(manager, *args, **kwargs)
        return
    from sglang.srt.eplb.expert_distribution import get_global_expert_distribution_recorder

    log.info("eplb_async: rebalance start")
    t0 = time.perf_counter()
    recorder = get_global_expert_distribution_recorder()
    _skip_first_dump_empty_cache(recorder)
    out = recorder.dump_record(output_mode="object")
    if not manager._check_rebalance_needed(out["average_utilization_rate_over_window"]):
        return
    t1 = time.perf_counter()
    before = list(st.pass_ends)
    counts, ready = out["logical_count"], None
    if isinstance(counts, torch.Tensor) and counts.is_cuda:  # the placement thread copies them once ready
        ready = torch.cuda.Event()
        ready.record()
    if st.group is None:  # first use, or re-created after an aborted migration (lockstep)
        st.group = _new_group()
    st.seq += 1
    job = _Job(manager, st.group, counts, ready, f"r{st.seq}", mode, st)
    rec = {"id": job.mid, "launch": mode.launch, "outcome": "running", "error": None, "gate_steps": 0,
           "migration_steps": 0}
    st.history.append(rec)
    del st.history[:-100]
    job.thread.start()
    rec["dump_s"] = t1 - t0  # upstream's dump_record and check, on this boundary
    rec["start_s"] = time.perf_counter() - t1  # our share of this boundary
    ex = None
    work = []  # the decode thread's time in our boundary work (gate step, maybe_switch: posts and switches), s
    switch_at = set()  # positions in `work` of the boundaries that switched layers
    st.during = []  # after_pass stamps this boundary and every later one: a pass plus our boundary work
    try:
        while True:  # phase 1: placement in the background, start gate
            yield
            rec["gate_steps"] += 1
            t = time.perf_counter()
            dec = job.gate.step()
            work.append(time.perf_counter() - t)
            if dec is None or dec[0] == "wait":
                continue
            break
        rec["placement_steps"] = list(job.steps)
        rec["executor_build_ms"] = dict(getattr(job.executor, "build_ms", None) or {})
        if job.steps:
            log.info("eplb_async: rebalance %s placement thread: %s ms (executor: %s; upstream dump %.1f ms before it)",
                     job.mid, ", ".join(f"{n} {b - a:.1f}" for n, a, b in job.steps),
                     ", ".join(f"{k} {v:.1f}" for k, v in rec["executor_build_ms"].items()) or "-", 1e3 * rec["dump_s"])
        if dec[0] == "abort":
            rec.update(outcome="aborted", error=dec[1])
            log.error("eplb_async: rebalance %s aborted before any transfer: %s; the old placement "
                      "stays", job.mid, dec[1])
            return
        ex, plan = job.executor, job.plan
        rec["launch"] = job.launch
        unchanged = sorted(set(map(int, manager._get_model().routed_experts_weights_of_layer))
                           - set(plan.layers))
        job.switch_rows(unchanged)  # same weights either way; the maps may still differ in order
        log.info("eplb_async: rebalance %s: %s; posted by the %s", job.mid, plan.summary(),
                 "decode loop" if job.launch == "boundary" else "transfer thread")
        ex.start()
        while ex.status.state == "running":  # phase 2: transfers in the background, switches here
            yield
            rec["migration_steps"] += 1
            t = time.perf_counter()
            switched = ex.maybe_switch()
            work.append(time.perf_counter() - t)
            if switched:
                switch_at.add(len(work) - 1)
            if switched and ex.status.state == "running":  # progress of a long migration, one line per chunk
                log.info("eplb_async: rebalance %s: layers %s switched after %d migration passes (%d of %d layers)",
                         job.mid, switched, rec["migration_steps"], len(ex.status.switched_layers),
                         len(plan.layers))
        s = ex.status
        rec.update(outcome=s.state, error=s.error, switched=s.switched_layers)
        if s.state == "aborted":  # its P2P state is unusable; a new group at the next rebalance
            st.dead_groups.append(st.group)  # (destroying a gloo group here took ~80 ms)
            st.group = None
            return
        if getattr(manager._server_args, "ep_dispatch_algorithm", None) == "lp":
            from sglang.srt.model_executor.model_runner_components.moe_ep_setup import init_lplb_solvers

            init_lplb_solvers(model_config=manager._model_config)
        rec.update(boundary_work_mean_s=float(np.mean(work)) if work else 0.0,
                   boundary_work_max_s=max(work, default=0.0),
                   switch_work_max_s=max((work[k] for k in switch_at), default=0.0),
                   received_bytes=s.bytes_received, pulled_bytes=s.pulled_bytes)
        log.info("eplb_async: rebalance %s end: %d layers switched over %d forward passes "
                 "(placement %d, migration %d); boundary work on the decode thread: mean %.0f us, max %.2f ms "
                 "(at switches: max %.2f ms); received %.2f GB, %.2f GB of it pulled by peer copies", job.mid,
                 len(s.switched_layers), rec["gate_steps"] + rec["migration_steps"], rec["gate_steps"],
                 rec["migration_steps"], 1e6 * rec["boundary_work_mean_s"], 1e3 * rec["boundary_work_max_s"],
                 1e3 * rec["switch_work_max_s"], s.bytes_received / 1e9, s.pulled_bytes / 1e9)
        if mode.verify:  # off the decode thread, after the switch copies enqueued so far
            done = None
            if job.executor._cuda:
                done = torch.cuda.Event()
                done.record()
            threading.Thread(target=job.check_moved, args=(rec, done), daemon=True,
                             name=f"eplb-async-verify-{job.mid}").start()
        spanned = [*st.during, (time.perf_counter(), None)]  # up to this boundary (its pass is unknown yet)
        intervals = rebalance_intervals(spanned, before)
        for kind, key, which in (("pass", "passes", "all"), ("decode pass", "decode_passes", "decode")):
            during, steady = (interval_summary(intervals[f"{which}_{when}"]) for when in ("during", "before"))
            rec.update({key + "_during": during, key + "_before": steady})
            if during["n"] and steady["n"]:
                log_pass_intervals(job.mid, during, steady, kind)
        dump_dir = os.environ.get("SGLANG_H20_OBSERVE_DIR")
        if dump_dir:
            passes = {**rebalance_passes(spanned, work, rec["gate_steps"], switch_at, job.t0),
                      "placement_steps": rec["placement_steps"], "executor_build_ms": rec["executor_build_ms"]}
            threading.Thread(target=dump_intervals, args=(dump_dir, job.mid, intervals, passes), daemon=True,
                             name=f"eplb-async-dump-{job.mid}").start()
    finally:
        st.during = None
        job.stop.set()
        if rec["outcome"] == "running":  # generator dropped (reset_generator) mid-way
            rec["outcome"] = "closed"
            if ex is not None:
                ex.close(timeout=0)
                st.dead_groups.append(st.group)
                st.group = None


def hooks(settings: Settings) -> list[Hook]:
    """The eplb_async feature's patch surface (empty when the switch is off)."""
    if not settings["eplb_async"]:
        return []
    if settings["eplb_async_launch"] == "thread":
        log.warning("eplb_async: SGLANG_H20_EPLB_ASYNC_LAUNCH=thread posts transfers from a background thread: "
                    "it hung 3 of 4 real EP-2 servers on the H200 (rebalances every 100 passes); A/B runs only")
    return [Hook(INIT_TARGET, after_init, "after"),
            Hook(REBALANCE_TARGET, make_around_rebalance(Mode(settings["eplb_async_launch"],
                                                              settings["eplb_async_verify"],
                                                              settings["eplb_async_shuffle"],
                                                              settings["eplb_async_peer"],
                                                              layered=settings["eplb"] != "affinity")), "around"),
            Hook(PASS_TARGET, after_pass, "after"), Hook(FORWARD_TARGET, before_forward, "before"),
            eplb_off_check(_note, "there is no rebalance to run without stalling decode")] + (
        [Hook(RUNNER_INIT_TARGET, after_model_init, "after")] if settings["eplb_async_peer"] else [])
