#!/usr/bin/env python3
"""Decode step time while the MoE expert weights are re-placed: ours (side stream) vs blocking.

Question (issue 7, and its multi-GPU follow-up): does a full re-placement of the MoE layers stall
decode? No server: the MoE weights are allocated directly in the shapes SGLang holds them (per MoE
layer, for E local slots: w13 [E, 2I, H] fp8 + block scales [E, 2I/128, H/128] fp32, w2 [E, H, I]
fp8 + scales), and the decode step is a documented GPU-shaped stand-in:

  decode step  = for each MoE layer: the FP8 block-scaled grouped GEMM gate_up over the routed
                 (token, expert) rows (contiguous layout, sgl_kernel_ext.grouped_gemm_fp8, the
                 kernel of our swapab feature), SiLU*mul + per-token-group FP8 quant, the down
                 grouped GEMM; bs x topk rows spread over the E slots by a fixed random routing.
                 Captured once in a CUDA graph (pointers to the live expert tensors), replayed per
                 step, then a stream sync (SGLang syncs each step for the sampled tokens).
                 With --world N > 1 every step also all-reduces 64 x H bf16 on the default group
                 (outside the graph): EP ranks synchronise every step, so they run in lockstep and
                 a slow rank slows all of them. A step's time is the max over ranks.
  re-placement = every slot of every MoE layer gets another expert (a random derangement per
                 layer of all N x E slots of the host): on one GPU every move is a local copy; on
                 N GPUs (topology 1 node x N) about 1/N of the moves are local and the rest are
                 P2P copies between GPUs (NVLink).
  ours         = sglang_h20.eplb: migration_plan.plan_migration + migration.MigrationExecutor (world 1: in-process
                 store; world N: the default group's store and a dedicated migration process group,
                 so its P2P never interleaves with the step's all-reduce): local copies and P2P
                 batches into staging on its side CUDA stream, paced at --copy-gbps, started at the
                 same step on every rank; a layer's staging is copied into the live slots on the
                 compute stream between two steps (maybe_switch, called between steps on every
                 rank), staging budget one layer (as upstream's temp buffers).
  blocking     = the same kind of plan run as SGLang 0.5.17's updater does it: between two steps,
                 layer by layer, local copies and one batch of P2P ops (batch_isend_irecv, waited)
                 into a temp buffer, then into the live slots, then the next step (its time lands
                 in one step).

Windows: steady (no migration), ours (from start() until done, plus 10 steps), blocking (the same
number of steps, migration before the first). Per window: p50 / p99 / max step time (ms) and
p99 / steady p50 and p99 / steady p99. After each migration every slot on every rank is checked
against the expert it should hold (per-slot byte fingerprints, gathered to every rank). Presets:
dsv3-4l (the 4-layer dummy model of scripts/make_model.py on one GPU: 3 MoE layers x 256 experts,
34 GB) and ep16-slice (what one GPU of EP16 holds for DeepSeek-V3: 58 MoE layers x 18 slots, 46 GB
per GPU; the default for --world N > 1); each is skipped when --deadline-s would be exceeded.
--device cpu runs a tiny smoke version (torch matmuls, no graph; with --world N: N processes on
gloo) for CI. With --world N the JSON has the same keys plus "world", and bytes moved between GPUs
vs locally per window (bytes_cross_gpu_gb, bytes_local_gb); the NCCL path needs N visible GPUs.

usage: migration_step_time.py [--json OUT] [--deadline-s 220] [--presets dsv3-4l ep16-slice] [--world N]
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from sglang_h20 import provenance
from sglang_h20.cliargs import positive_int
from sglang_h20.eplb.async_rebalance import TUNING, nccl_options
from sglang_h20.eplb.migration import LAUNCH_MODES, MigrationExecutor, connect_peers, pacing
from sglang_h20.eplb.migration_plan import KINDS, plan_migration
from sglang_h20.eplb.placement import Placement, Topology

H, I = 7168, 2048  # DeepSeek-V3 hidden / moe_intermediate
PRESETS = {  # MoE layers, local expert slots (per GPU), tokens per step (bs), top-k
    "dsv3-4l": dict(layers=3, slots=256, bs=64, topk=8),
    "ep16-slice": dict(layers=58, slots=18, bs=64, topk=8),
    "cpu-smoke": dict(layers=3, slots=8, bs=4, topk=2),
}


def make_weights(layers: int, slots: int, dev: torch.device, h: int, i: int) -> dict[int, list]:
    """SGLang's routed_experts_weights_of_layer for one GPU: random FP8 (no NaN codes), scales ~1e-3."""
    out = {}
    for l in range(layers):
        w13 = torch.empty(slots, 2 * i, h, dtype=torch.uint8, device=dev).random_(0, 0x7F)
        w2 = torch.empty(slots, h, i, dtype=torch.uint8, device=dev).random_(0, 0x7F)
        fp8 = torch.float8_e4m3fn
        s13 = torch.rand(slots, 2 * i // 128, h // 128, device=dev) * 1e-3
        s2 = torch.rand(slots, h // 128, i // 128, device=dev) * 1e-3
        out[l] = [w13.view(fp8), s13, w2.view(fp8), s2]
    return out


def fingerprint(weights) -> dict[int, torch.Tensor]:
    """Per layer, per slot: byte sums of every tensor (int64 [slots, tensors]), to check moves."""
    return {l: torch.stack([t.view(torch.uint8).reshape(t.shape[0], -1).sum(1, dtype=torch.int64)
                            for t in ws], dim=1).cpu() for l, ws in weights.items()}


class Ranks:
    """This process's place in the host (world 1: no torch.distributed at all) and the few collectives
    the benchmark itself needs, all on the default group and outside the timed region."""

    def __init__(self, rank: int = 0, world: int = 1, dev: torch.device = torch.device("cpu")):
        self.rank, self.world, self.dev = rank, world, dev

    def agree(self, flag: bool) -> bool:
        """True on every rank if it is True on any: loops must leave at the same step everywhere."""
        if self.world == 1:
            return flag
        t = torch.tensor([int(flag)], device=self.dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def max_over_ranks(self, xs: list[float]) -> list[float]:
        """Element-wise max over ranks; per step, the slowest rank's time is the step time of lockstep
        EP decode."""
        return np.max(np.asarray(self.gather(xs)), axis=0).tolist()

    def fingerprint(self, weights) -> dict[int, torch.Tensor]:
        """fingerprint() of the whole host: every rank's slots, in global slot order."""
        fps = self.gather(fingerprint(weights))
        return {l: torch.cat([fp[l] for fp in fps]) for l in fps[0]}


class DecodeStep:
    """The stand-in decode step over the live expert tensors (see the module docstring)."""

    def __init__(self, weights, bs: int, topk: int, dev: torch.device, graph: bool, seed: int = 0,
                 ep_sync: bool = False):
        self.weights, self.dev = weights, dev
        slots = next(iter(weights.values()))[0].shape[0]
        rows = bs * topk
        g = torch.Generator().manual_seed(seed)
        counts = torch.bincount(torch.randint(0, slots, (rows,), generator=g), minlength=slots)
        self.indptr = torch.zeros(slots + 1, dtype=torch.int32)
        self.indptr[1:] = torch.cumsum(counts, 0)
        self.indptr = self.indptr.to(dev)
        h = next(iter(weights.values()))[0].shape[2]
        self.a = (torch.randn(rows, h, device=dev) * 0.5).to(torch.float8_e4m3fn)
        self.a_s = torch.full((rows, h // 128), 1e-2, device=dev)
        # EP's per-step synchronisation (zeros, so the sum never grows): ranks run in lockstep
        self.sync = torch.zeros(64, h, dtype=torch.bfloat16, device=dev) if ep_sync else None
        self.cpu = dev.type == "cpu"
        self.graph = None
        if not self.cpu:
            from sgl_kernel_ext.grouped_gemm_fp8 import m_grouped_fp8_gemm_nt_contiguous
            from sgl_kernel_ext.quant import silu_mul_quant_fp8

            self._gemm, self._act = m_grouped_fp8_gemm_nt_contiguous, silu_mul_quant_fp8
            for _ in range(2):  # compile + warm up outside the capture
                self._body()
            torch.cuda.synchronize()
            if graph:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    self._body()
                torch.cuda.current_stream().wait_stream(s)
                self.graph = torch.cuda.CUDAGraph()
                # thread_local: NCCL's watchdog thread polls events meanwhile (world > 1), which the
                # default "global" mode counts as an illegal call during capture
                with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                    self._body()
                torch.cuda.synchronize()

    def _body(self):
        out = None
        for l, (w13, s13, w2, s2) in self.weights.items():
            if self.cpu:  # smoke: the same data flow with float matmuls on a few rows
                x = self.a.float()[:8] @ w13[0].float().T
                out = x[:, : x.shape[1] // 2] @ w2[0].float().T
                continue
            up = self._gemm(self.a, self.a_s, w13, s13, self.indptr)
            q, qs = self._act(up)
            out = self._gemm(q, qs, w2, s2, self.indptr)
        return out

    def __call__(self):
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body()
        if self.sync is not None:
            dist.all_reduce(self.sync)
        if not self.cpu:
            torch.cuda.current_stream().synchronize()


def stats(ms: list[float]) -> dict:
    a = np.asarray(ms)
    return {"steps": int(a.size), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max()), "mean_ms": float(a.mean())}


def over_steady(window: dict, steady: dict) -> dict:
    """A migration window's tail against the steady window (no migration): p99 and max step over the steady
    median, p99 over the steady p99 (the issue's bound is p99 <= 1.05x steady)."""
    return {"p99_over_steady_p50": window["p99_ms"] / steady["p50_ms"],
            "p99_over_steady_p99": window["p99_ms"] / steady["p99_ms"],
            "max_over_steady_p50": window["max_ms"] / steady["p50_ms"]}


def link_gb(plan) -> dict:
    """Bytes the plan moves between GPUs (NVLink/network P2P) and inside a GPU (local copies)."""
    lb = plan.totals["link_bytes"]
    return {"bytes_cross_gpu_gb": (lb["nvlink"] + lb["network"]) / 1e9, "bytes_local_gb": lb["gpu"] / 1e9}


def run_blocking(plan, weights, rank: int = 0, group=None) -> None:
    """SGLang 0.5.17's updater (update_expert_weights_single_layer) on this rank: per layer, local
    copies and one batch of P2P ops into temp buffers, waited for, then the temps into the live slots.
    Forwards (a copy of another slot's incoming expert, multi-node plans only) go in a later batch."""
    k = plan.old.topology.slots_per_gpu
    for l in plan.layers:
        ws = weights[l]
        temps = [torch.empty_like(t) for t in ws]  # create_temp_buffers: one layer
        mine = [t for t in plan.transfers if t.layer == l and rank in (t.src_rank, t.dst_rank)]
        for kind in KINDS:  # local, nvlink, network, forward
            ops = []
            for t in (t for t in mine if t.kind == kind):  # tid order: how both ends match P2P ops
                src = temps if t.from_staging else ws  # a forward reads its head's temp slot
                sj, dj = t.src_slot - t.src_rank * k, t.dst_slot - t.dst_rank * k
                for n, (s, d) in enumerate(zip(src, temps)):
                    if t.src_rank == t.dst_rank:
                        d[dj].copy_(s[sj])
                    elif t.src_rank == rank:
                        ops.append(dist.P2POp(dist.isend, s[sj], group=group, group_peer=t.dst_rank,
                                              tag=t.tid * len(ws) + n))
                    else:
                        ops.append(dist.P2POp(dist.irecv, d[dj], group=group, group_peer=t.src_rank,
                                              tag=t.tid * len(ws) + n))
            if ops:
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
        for t in mine:
            if t.dst_rank == rank:
                dj = t.dst_slot - rank * k
                for tmp, w in zip(temps, ws):
                    w[dj].copy_(tmp[dj])
        del temps


def moved_ok(fp_before, fp_after, old, new) -> bool:
    """Slot s of layer l now holds what the slot holding expert new[l, s] held before."""
    for l in fp_before:
        where = {int(e): s for s, e in enumerate(old[l])}
        src = torch.tensor([where[int(e)] for e in new[l]])
        if not torch.equal(fp_after[l], fp_before[l][src]):
            return False
    return True


def derangement(rng: np.random.Generator, n: int) -> np.ndarray:
    """A random permutation of n with no fixed point, drawn per layer (about e tries each): resampling
    all layers at once until none has a fixed point never ends for many layers (0.37**layers)."""
    while True:
        p = rng.permutation(n)
        if not (p == np.arange(n)).any():
            return p


def run_preset(name: str, cfg: dict, a, dev: torch.device, deadline: float, rk: Ranks = Ranks(),
               group=None) -> dict:
    """One preset on this rank (every rank runs it in lockstep); `group`: the migration group."""
    layers, slots, world = cfg["layers"], cfg["slots"], rk.world
    h, i = (H, I) if dev.type == "cuda" else (256, 128)
    t0 = time.monotonic()
    torch.manual_seed(rk.rank)  # distinct weights per rank, so a swapped slot cannot pass the check
    weights = make_weights(layers, slots, dev, h, i)
    expert_bytes = sum(t[0].numel() * t.element_size() for t in weights[0])
    step = DecodeStep(weights, cfg["bs"], cfg["topk"], dev, graph=dev.type == "cuda", ep_sync=world > 1)
    topo = Topology(num_nodes=1, gpus_per_node=world, slots_per_gpu=slots)
    n_slots = world * slots
    rng = np.random.default_rng(0)  # the same placements on every rank
    ident = np.tile(np.arange(n_slots), (layers, 1))
    perm = np.stack([derangement(rng, n_slots) for _ in range(layers)])  # every slot changes
    p_old, p_new = Placement(ident, topo, n_slots), Placement(perm, topo, n_slots)
    budget = a.staging_layers * slots * expert_bytes
    res = {"layers": layers, "slots": slots, "bs": cfg["bs"], "topk": cfg["topk"],
           "expert_bytes": expert_bytes, "live_gb": layers * slots * expert_bytes / 1e9,
           "staging_budget_gb": budget / 1e9, "setup_s": None}

    def timed(n, before=None):
        ms = []
        for k in range(n):
            s0 = time.perf_counter()
            if before is not None:
                before(k)
            step()
            ms.append((time.perf_counter() - s0) * 1e3)
        return ms

    timed(20)
    res["setup_s"] = time.monotonic() - t0
    if rk.rank == 0:
        print(f"{name}: set up in {res['setup_s']:.1f} s ({res['live_gb']:.1f} GB of expert weights"
              f"{' per GPU' if world > 1 else ''})", flush=True)
    res["steady"] = stats(rk.max_over_ranks(timed(a.steady_steps)))

    # ours: executor on the side stream, maybe_switch between steps
    fp0 = rk.fingerprint(weights)
    plan = plan_migration(p_old, p_new, expert_bytes, budget)
    ex = MigrationExecutor(rk.rank, world, topo, weights, plan, group=group, timeout_s=120.0,
                           store=torch.distributed.HashStore() if world == 1 else None,
                           switch_every=a.switch_every, decide_ahead=a.decide_ahead,
                           migration_id=f"bench-{name}",
                           **pacing(a.launch, expert_bytes, a.transfers_per_boundary, a.copy_gbps))
    ours, switch_ms = [], []
    tm = time.monotonic()
    ex.start()
    tail, mig_s = None, math.nan
    while tail is None or tail > 0:
        # the deadline check is collective with several ranks, so every 32 steps only
        if (world == 1 or len(ours) % 32 == 0) and rk.agree(time.monotonic() >= deadline):
            break
        s0 = time.perf_counter()
        step()
        s1 = time.perf_counter()
        ex.maybe_switch()
        s2 = time.perf_counter()
        ours.append((s2 - s0) * 1e3)
        switch_ms.append((s2 - s1) * 1e3)
        if tail is None and ex.status.state != "running":  # same boundary on every rank
            tail, mig_s = 10, time.monotonic() - tm
        elif tail is not None:
            tail -= 1
    st = ex.status
    ex.close(timeout=5)
    if st.state != "done":
        res["ours"] = {"state": st.state, "error": st.error or "deadline"}
        return res
    if dev.type == "cuda":
        torch.cuda.synchronize()
    ok_ours = moved_ok(fp0, rk.fingerprint(weights), ident, perm)
    ours, switch_ms = rk.max_over_ranks(ours), rk.max_over_ranks(switch_ms)
    mig_s, peak = rk.max_over_ranks([mig_s, st.peak_staging_bytes])
    res["ours"] = {**stats(ours), "migration_s": mig_s, "migration_steps": len(ours) - 10,
                   "max_maybe_switch_ms": max(switch_ms), "chunks": len(plan.chunks),
                   "bytes_copied_gb": plan.totals["total_bytes"] / 1e9, "bit_identical": ok_ours,
                   "peak_staging_gb": peak / 1e9}
    if world > 1:
        res["ours"].update(link_gb(plan))

    # blocking: the reverse re-placement (same size), all of it between two steps
    if rk.agree(time.monotonic() > deadline):
        res["blocking"] = {"skipped": "deadline"}
        return res
    back = plan_migration(p_new, p_old, expert_bytes, budget)
    fp1 = rk.fingerprint(weights)
    n = len(ours)
    blk = timed(n, before=lambda k: run_blocking(back, weights, rk.rank, group) if k == 0 else None)
    blk = rk.max_over_ranks(blk)
    ok_blk = moved_ok(fp1, rk.fingerprint(weights), perm, ident)
    res["blocking"] = {**stats(blk), "migration_step_ms": blk[0], "bit_identical": ok_blk}
    if world > 1:
        res["blocking"].update(link_gb(back))
    for k in ("ours", "blocking"):
        res[k].update(over_steady(res[k], res["steady"]))
    return res  # weights, staging and the graph are freed with this frame


def run_all(a, dev: torch.device, rk: Ranks) -> None:
    """Every preset in turn on this rank; rank 0 prints and writes the JSON (after every preset, so a
    run cut short keeps what it measured)."""
    presets = a.presets or (["cpu-smoke"] if dev.type == "cpu" else
                            ["dsv3-4l", "ep16-slice"] if rk.world == 1 else ["ep16-slice"])
    out = {"benchmark": "eplb_migration_step_time", "provenance": provenance.record(),
           "stand_in": "decode step = per MoE layer FP8 grouped GEMMs (gate_up, SiLU*mul+quant, down) over "
                       "the live expert tensors in a CUDA graph; see the script's docstring",
           "switch_every": a.switch_every, "decide_ahead": a.decide_ahead, "copy_gbps": a.copy_gbps,
           "launch": a.launch, "transfers_per_boundary": a.transfers_per_boundary}
    if rk.world > 1:
        out["world"] = rk.world
    out["presets"] = {}

    def write(text):
        if rk.rank == 0 and a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(text + "\n")

    for name in presets:
        left = a.deadline - time.monotonic()
        if rk.agree(left < 30 and dev.type == "cuda"):
            out["presets"][name] = {"skipped": f"deadline ({left:.0f} s left)"}
            continue
        group = None
        if rk.world > 1:  # the migration's own group; NCCL wants its first op to include every rank
            group = dist.new_group(list(range(rk.world)), pg_options=nccl_options() if dev.type == "cuda" else None)
            dist.all_reduce(torch.zeros(1, device=dev), group=group)
            connect_peers(group, dev)  # as the server's migration group: P2P set up before the steps
        try:
            r = run_preset(name, PRESETS[name], a, dev, a.deadline, rk, group)
        except torch.cuda.OutOfMemoryError as e:
            if rk.world > 1:  # the other ranks would wait in a collective: fail the whole run
                raise
            r = {"error": f"out of memory: {e}"}
        out["presets"][name] = r
        write(json.dumps(out, indent=1))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        s = lambda k: r.get(k, {})
        if rk.rank == 0:
            print(f"{name}: steady p50 {s('steady').get('p50_ms', math.nan):.2f} ms p99 "
                  f"{s('steady').get('p99_ms', math.nan):.2f} | ours p99 {s('ours').get('p99_ms', math.nan):.2f} "
                  f"max {s('ours').get('max_ms', math.nan):.2f} over {s('ours').get('migration_steps', 0)} steps | "
                  f"blocking p99 {s('blocking').get('p99_ms', math.nan):.2f} max "
                  f"{s('blocking').get('max_ms', math.nan):.2f}", flush=True)
    out["wall_s"] = time.monotonic() - a.start
    text = json.dumps(out, indent=1)
    if a.json:
        write(text)
    elif rk.rank == 0:
        print(text)


def _rank_main(rank: int, a, port: int) -> None:
    """One process per GPU (torch.multiprocessing.spawn): NCCL on cuda:rank, gloo on CPU."""
    cuda = a.device == "cuda"
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    else:
        torch.set_num_threads(1)  # N processes share the host's cores
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=a.world, device_id=dev if cuda else None,
                            timeout=datetime.timedelta(seconds=max(300.0, a.deadline_s)))
    run_all(a, dev, Ranks(rank, a.world, dev))
    dist.barrier()
    # no process-group teardown: an aborted migration can leave P2P waits behind
    os._exit(0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None,
                    help="write the results here (rewritten after every preset)")
    ap.add_argument("--deadline-s", type=float, default=220.0, help="skip what would not finish by then")
    ap.add_argument("--presets", nargs="+", default=None, choices=sorted(PRESETS),
                    help="default: dsv3-4l ep16-slice (--world 1), ep16-slice (--world N), cpu-smoke (--device cpu)")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cuda (default): the GPU measurement; cpu: the tiny smoke version for CI")
    ap.add_argument("--world", type=int, default=1,
                    help="GPUs (processes) of this host; > 1: experts move between them (1 node x N)")
    ap.add_argument("--steady-steps", type=int, default=200,
                    help="decode steps of the steady window (default: %(default)s)")
    ap.add_argument("--switch-every", type=int, default=2,
                    help="ours: steps between two switch boundaries (MigrationExecutor; default: %(default)s)")
    ap.add_argument("--decide-ahead", type=int, default=1,
                    help="ours: boundaries before a switch its decision is fetched, < --switch-every "
                         "(default: %(default)s)")
    ap.add_argument("--staging-layers", type=int, default=1,
                    help="ours: staging budget, in layers of expert weights (default: %(default)s)")
    ap.add_argument("--copy-gbps", type=float, default=TUNING.copy_gbps or 0.0,
                    help="launch thread: pace of our side-stream copies, GB/s (0: unpaced); default: the plugin's")
    ap.add_argument("--launch", choices=LAUNCH_MODES, default="boundary",
                    help="who posts the transfers: the step loop between steps (the plugin's default) or a "
                         "background thread (default: %(default)s)")
    ap.add_argument("--transfers-per-boundary", type=positive_int, default=TUNING.transfers_per_boundary,
                    help="launch boundary: experts each rank sends (and receives) per step boundary "
                         "(default: the plugin's, %(default)s)")
    a = ap.parse_args()
    a.start = time.monotonic()  # CLOCK_MONOTONIC is host-wide: the spawned ranks share the deadline
    a.deadline = a.start + a.deadline_s
    if a.world < 1:
        ap.error("--world must be >= 1")
    for flag, value in (("--steady-steps", a.steady_steps), ("--switch-every", a.switch_every),
                        ("--staging-layers", a.staging_layers)):
        if value < 1:
            ap.error(f"{flag} must be >= 1, got {value}")
    if not 0 <= a.decide_ahead < a.switch_every:
        ap.error(f"--decide-ahead must be >= 0 and < --switch-every ({a.switch_every}), got {a.decide_ahead}")
    if a.copy_gbps < 0:
        ap.error(f"--copy-gbps must be >= 0, got {a.copy_gbps}")
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a CUDA GPU and none is visible (--device cpu runs the CPU smoke version)")
    if a.world == 1:
        run_all(a, torch.device(a.device), Ranks())
        return
    if a.device == "cuda" and torch.cuda.device_count() < a.world:
        ap.error(f"--world {a.world} needs {a.world} visible GPUs, found {torch.cuda.device_count()}")
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(a, free_port()), nprocs=a.world, join=True)


if __name__ == "__main__":
    main()
