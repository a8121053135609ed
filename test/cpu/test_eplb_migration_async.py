"""eplb_async: SGLang's EPLB rebalance driven through our hooks (sglang_h20.eplb.async_rebalance).

4 spawned processes on real gloo = 2 nodes x 2 ranks. Each loads the plugin with
SGLANG_H20_EPLB_ASYNC=on (real HookRegistry patching of the installed sglang), builds SGLang's real
EPLBManager and ExpertLocationMetadata (init_trivial: 4 layers, layer 0 dense, 8 experts + 4
redundant = 3 slots per rank, static dispatch) and lets the real `init_by_eplb` + deepseek
algorithm place. Thin stand-ins: the runtime context (get_exec/get_parallel), the model config,
the model (routed_experts_weights_of_layer: two tensors per layer) and the distribution recorder
(all-reduces per-rank counts, as upstream's dump_record does). The placement is slowed by
PLACEMENT_STEPS decode steps (it waits for the loop to run them), and every transfer stage by
GATE_STEPS steps (test_eplb_migration.StepGate): work tied to decode progress rather than to wall
time, so (a) holds on any host, and a hook that waited on that work would stand still until the gate
times out. A paced "decode loop" checks, before each on_forward_pass_end, that every MoE
layer's routing fields agree with each other and with the weights they route to:
  (a) the loop keeps stepping while the placement is computed and while weights move;
  (b) every step sees, per layer, the old or the new placement (maps and weights), flipping once,
      at the same step on every rank;
  (c) at the end the weights are bit-identical to the new placement, layer 0 untouched;
  (d) no on_forward_pass_end call takes longer than STALL_BOUND_S;
  (e) a rank that cannot build its plan makes every rank abort at the same step before any
      transfer, and a rank killed mid-migration makes every survivor abort with no layer switched
      (their abort steps are printed, not compared: see that test); the old placement stays, one
      error line per rank each time.
Three rebalances run in one world (the sglang import dominates the runtime): ok, plan failure, kill.
"""
from __future__ import annotations

import datetime
import inspect
import json
import logging
import os
import pathlib
import pickle
import re
import sys
import threading
import time
import types

import numpy as np
import pytest
import torch

import test_eplb_migration as tem
from test_eplb_migration import (LOOP_DEADLINE_S, STALL_BOUND_S, WORLD, DyingBoundaryExecutor, DyingExecutor,
                                 GatedExecutor, StepGate, _Count,
                                 check_consistent, checksum, exit_when_released, expert_weight, free_port, join_world)

NUM_LAYERS, MOE = 4, (1, 2, 3)  # labels per MoE layer: check_consistent expects 3 columns
E, REDUNDANT, K = 8, 4, 3
PERIOD_S = 0.002
REBALANCE_AFTER = 12              # eplb_rebalance_num_iterations
PLACEMENT_STEPS = 20              # the placement returns only after the decode loop ran this many more steps
# distinct per-expert token counts: the checksum weighs each slot by its expert's count, so weights that do not
# follow the routing map (two local slots swapped, say) change it; equal counts would hide any such permutation
TOKENS = np.arange(1, E + 1, dtype=np.int64) * 3


def _stand_ins():
    from types import SimpleNamespace as NS

    from sglang.srt import runtime_context as rc
    from sglang.srt.eplb import expert_location as el

    par = NS(ep_size=WORLD, nnodes=2, elastic_ep_initial_size=None, max_ep_size=None)
    exe = NS(moe=NS(ep_num_redundant_experts=REDUNDANT, ep_dispatch_algorithm="static",
                    moe_a2a_backend="none", ep_join_mode="none"))
    rc.get_parallel, rc.get_exec = (lambda: par), (lambda: exe)
    el.ModelConfigForExpertLocation.from_model_config = staticmethod(
        lambda mc: el.ModelConfigForExpertLocation(NUM_LAYERS, E, None))
    return NS(eplb_algorithm="auto", device="cpu", nnodes=2, tp_size=WORLD,
              eplb_rebalance_layers_per_chunk=None, eplb_rebalance_num_iterations=REBALANCE_AFTER,
              expert_distribution_recorder_buffer_size=1, eplb_min_rebalancing_utilization_threshold=1.0,
              ep_dispatch_algorithm="static", ep_join_rank_offset=0)


class Recorder:
    """SGLang's recorder as EPLBManager uses it: dump_record all-reduces the logical counts."""

    recording = True

    def __init__(self, rank):
        self.rank, self.dump_s = rank, []
        self._accumulator = types.SimpleNamespace(_first_dump=True)  # upstream's stat accumulator's flag
        self.reseed(0)

    def reseed(self, phase):
        rng = np.random.default_rng(100 * phase + self.rank)
        self.counts = torch.tensor(rng.integers(0, 50, (NUM_LAYERS, E)) ** 2, dtype=torch.int64)

    def start_record(self):
        pass

    def dump_record(self, output_mode="file"):
        t = time.perf_counter()
        c = self.counts.clone()
        torch.distributed.all_reduce(c)
        self.dump_s.append(time.perf_counter() - t)
        return {"logical_count": c, "average_utilization_rate_over_window": None}


def scale(layer, e):
    return torch.full((8,), layer * 10.0 + e, dtype=torch.float32)


def maps_agree(meta, l, row) -> bool:
    """Every routing field of layer l describes the same placement `row`."""
    if not (meta.physical_to_logical_map_cpu[l].numpy() == row).all():
        return False
    for e in range(E):
        slots = set(np.flatnonzero(row == e).tolist())
        for m in (meta.logical_to_all_physical_map, meta.logical_to_all_physical_map_cpu):
            got = [x for x in m[l, e].tolist() if x != -1]
            if set(got) != slots or len(got) != len(slots):
                return False
        if int(meta.logical_to_all_physical_map_num_valid[l, e]) != len(slots):
            return False
        if int(meta.logical_to_rank_dispatch_physical_map[l, e]) not in slots:
            return False
    return True


class FailingExecutor:
    """Rank 2 cannot build its executor: the start gate must abort every rank."""

    def __init__(self, rank, *args, **kwargs):
        raise RuntimeError(f"no executor on rank {rank}")


def _worker(rank: int, port: int, outdir: str, launch: str) -> None:
    """Three rebalances in one run: the first completes; in the second rank 2 fails to plan (abort
    before any transfer); in the third rank 3 dies mid-migration."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    tem.GATE = gate = StepGate()  # transfer stages of GatedExecutor / DyingExecutor wait on it too
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    sa = _stand_ins()
    from sglang.srt.eplb import eplb_algorithms
    from sglang.srt.eplb.eplb_manager import EPLBManager
    from sglang.srt.eplb.expert_distribution import set_global_expert_distribution_recorder
    from sglang.srt.eplb.expert_location import (ExpertLocationMetadata,
                                                 set_global_expert_location_metadata)

    from sglang_h20 import plugin
    from sglang_h20.eplb import async_rebalance as ar
    from sglang_h20.settings import Settings

    decisions = plugin.activate(Settings.from_env({"SGLANG_H20_EPLB_ASYNC": "on", "SGLANG_H20_EPLB_ASYNC_VERIFY": "on",
                                                   "SGLANG_H20_EPLB_ASYNC_LAUNCH": launch,
                                                   "SGLANG_H20_EPLB_ASYNC_PEER": "on"}))
    errors, lines = _Count(), _Count()
    lines.setLevel(logging.INFO)  # every line, for the migration's progress lines
    logging.getLogger("sglang_h20").addHandler(errors)
    logging.getLogger("sglang_h20").addHandler(lines)
    ar.TUNING = ar.Tuning(switch_every=8, decide_ahead=6, timeout_s=5.0, placement_timeout_s=20.0)
    upstream_place = eplb_algorithms.rebalance_experts

    def slow_place(*a, **k):
        gate.wait(PLACEMENT_STEPS)  # (a): the decode loop must run these steps while the placement is pending
        return upstream_place(*a, **k)

    eplb_algorithms.rebalance_experts = slow_place
    ar.EXECUTOR = GatedExecutor

    meta = ExpertLocationMetadata.init_trivial(sa, None, moe_ep_rank=rank)
    set_global_expert_location_metadata(meta)
    recorder = Recorder(rank)
    set_global_expert_distribution_recorder(recorder)
    ref = {(l, e): expert_weight(l, e) for l in range(NUM_LAYERS) for e in range(E)}
    stack = lambda l, row: torch.stack([ref[(l, int(row[rank * K + j]))] for j in range(K)])
    p2l0 = meta.physical_to_logical_map_cpu.numpy().copy()
    weights = {l: [stack(l, p2l0[l]).clone(), torch.stack([scale(l, int(p2l0[l, rank * K + j]))
                                                           for j in range(K)])] for l in MOE}
    model = type("Model", (), {"routed_experts_weights_of_layer": weights})()
    mgr = EPLBManager(server_args=sa, model_config=None, ps=type("PS", (), {"tp_rank": rank})(),
                      get_model=lambda: model, get_expert_location_updater=lambda: None,
                      get_expert_backup_client=lambda: None, get_weight_updater=lambda: None)

    runner = type("Runner", (), {"eplb_manager": mgr})()  # what before_forward reads of a ModelRunner
    ar.after_model_init(None, runner)  # SGLANG_H20_EPLB_ASYNC_PEER: the ModelRunner.initialize hook maps the peers
    res_peers = ar._state(mgr).peers   # here: CPU tensors not in shared files, so not possible on any rank
    def pass_batch(decode: bool, other_rank_extends: bool = False):
        mode = type("Mode", (), {"is_decode": lambda _: decode})()
        return type("Batch", (), {"forward_mode": mode, "is_extend_in_batch": other_rank_extends})()

    def bit_ok(p2l):
        return all(torch.equal(weights[l][0][j], ref[(l, int(p2l[l, rank * K + j]))])
                   and torch.equal(weights[l][1][j], scale(l, int(p2l[l, rank * K + j])))
                   for l in MOE for j in range(K))

    res = {"feature": [decisions["eplb_async"].on, decisions["eplb_async"].reason], "launch": launch,
           "startup_peers": res_peers}
    os.environ["SGLANG_H20_OBSERVE_DIR"] = dump_dir = os.path.join(outdir, f"dump_{launch}")
    dist.barrier()
    t0 = time.monotonic() + 0.02
    step, deadline = 0, time.monotonic() + LOOP_DEADLINE_S
    for phase in (0, 1, 2):
        old = meta.physical_to_logical_map_cpu.numpy().copy()
        n_err, n_lines = len(errors.messages), len(lines.messages)
        rows, oks, call_s, own_s, end_step = [], [], [], [], None
        while time.monotonic() < deadline:
            wait = t0 + step * PERIOD_S - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            p2l = meta.physical_to_logical_map  # the forward pass: routing in force, weights it reads
            r, ok = [], []
            for l in MOE:
                row = p2l[l].numpy().copy()
                ok.append(maps_agree(meta, l, row) and checksum(weights[l][0], row, rank, TOKENS)
                          == checksum(stack(l, row), row, rank, TOKENS)
                          and torch.equal(weights[l][1], torch.stack([scale(l, int(row[rank * K + j]))
                                                                      for j in range(K)])))
                r.append(row)
            rows.append(r)
            oks.append(ok)
            dumps = len(recorder.dump_s)
            s0 = time.perf_counter()
            # ModelRunner.forward's BEFORE hook: a prefill pass in 7, and a decode pass in 7 beside another DP
            # rank's prefill; then the pass end, as forward does
            ar.before_forward(runner, pass_batch(step % 7 != 3, other_rank_extends=step % 7 == 5))
            mgr.on_forward_pass_end()
            call_s.append(time.perf_counter() - s0)
            own_s.append(call_s[-1] - sum(recorder.dump_s[dumps:]))  # minus upstream's all-reduce
            step += 1
            gate.step()
            hist = ar.history(mgr)
            if end_step is None and len(hist) == phase + 1 and hist[-1]["outcome"] != "running":
                end_step = step
            if end_step is not None and step >= end_step + 5:
                break
        wait_until = time.monotonic() + 10
        while phase == 0 and "verify" not in ar.history(mgr)[0] and time.monotonic() < wait_until:
            time.sleep(0.01)  # the verify thread reads every slot after the last switch
        dump = pathlib.Path(dump_dir) / f"eplb_async_r{phase + 1}_rank{rank}.json"
        while phase == 0 and not dump.exists() and time.monotonic() < wait_until:
            time.sleep(0.01)  # written by a thread after the rebalance's end line
        final = meta.physical_to_logical_map_cpu.numpy().copy()
        labels = np.array([[(0 if (row == old[l]).all() else 1 if (row == final[l]).all() else -1)
                            if good else -1 for l, row, good in zip(MOE, r, ok)]
                           for r, ok in zip(rows, oks)])
        res[phase] = dict(labels=labels, call_s=call_s, own_s=own_s, steps=len(rows), end_step=end_step,
                          history=[dict(h) for h in ar.history(mgr)], old=old, final=final,
                          bit_ok=bit_ok(final), errors=errors.messages[n_err:], gate_timeouts=gate.timeouts,
                          lines=lines.messages[n_lines:],
                          dump=json.loads(dump.read_text()) if dump.exists() else None,
                          first_dump_flag=recorder._accumulator._first_dump)
        recorder.reseed(phase + 1)  # new counts: the next placement differs
        if phase == 0 and rank == 2:
            ar.EXECUTOR = FailingExecutor
        if phase == 1:  # rank 3 will die after its first transfer stage
            dying = DyingBoundaryExecutor if launch == "boundary" else DyingExecutor
            ar.EXECUTOR = dying if rank == 3 else GatedExecutor
    tmp = os.path.join(outdir, f"rank{rank}.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(res, f)
    os.replace(tmp, os.path.join(outdir, f"rank{rank}.pkl"))
    exit_when_released(rank, outdir)  # rank 0 (the store's host) stays until the others are gone


@pytest.fixture(scope="module", params=["boundary", "thread"])
def world(tmp_path_factory, request):
    """One world per launch mode: transfers posted by the decode loop (the default) or by a thread."""
    import torch.multiprocessing as mp

    tmp_path = tmp_path_factory.mktemp("eplb_async")
    ctx = mp.get_context("spawn")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k.startswith("SGLANG_H20_")}
    for k in env:  # the workers' settings come from the test, not from the caller's shell
        os.environ.pop(k)
    procs = [ctx.Process(target=_worker, args=(r, port, str(tmp_path), request.param)) for r in range(WORLD)]
    t0 = time.monotonic()
    try:
        for p in procs:
            p.start()
        join_world(procs, str(tmp_path), t0)
    finally:
        os.environ.update(env)
    out = {r: pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes())
           for r in range(WORLD) if (tmp_path / f"rank{r}.pkl").exists()}
    print(f"\n[eplb_async] wall {time.monotonic() - t0:.1f} s, exit codes {[p.exitcode for p in procs]}")
    for r, res in out.items():
        for ph in (0, 1, 2):
            x = res[ph]
            print(f"  rank {r} rebalance {ph}: steps {x['steps']} {x['history'][ph]} max "
                  f"on_forward_pass_end {max(x['call_s']) * 1e3:.2f} ms (ours {max(x['own_s']) * 1e3:.2f} ms), "
                  f"gate timeouts {x['gate_timeouts']}")
    return [p.exitcode for p in procs], out


def test_async_rebalance_through_sglang_hooks(world):
    codes, out = world
    assert codes[:3] == [0, 0, 0] and sorted(out) == [0, 1, 2]
    flips = []
    for r, res in out.items():
        assert res["feature"][0], res["feature"]
        x = res[0]
        h = x["history"][0]
        assert h["outcome"] == "done" and h["error"] is None and x["errors"] == []
        assert h["launch"] == res["launch"]  # SGLANG_H20_EPLB_ASYNC_LAUNCH reached the executor
        # (g) SGLANG_H20_EPLB_ASYNC_VERIFY: every local slot of every MoE layer holds its new expert's bytes
        assert h["verify"] == {"slots": len(MOE) * K, "layers": len(MOE), "mismatched": 0, "first": []}
        # (a) the loop kept stepping during the placement (which waits for PLACEMENT_STEPS of them) and during
        # the migration (each stage waits for steps), and nothing waited for a gate until it timed out
        assert x["gate_timeouts"] == 0
        assert h["gate_steps"] >= PLACEMENT_STEPS and h["migration_steps"] >= 8
        # (b) old or new per layer, every step; flips once
        f = check_consistent(x)
        changed = [i for i, l in enumerate(MOE) if (x["final"][l] != x["old"][l]).any()]
        assert len(changed) >= 2 and sorted(f) == changed
        flips.append(f)
        # (c) bit-identical weights; the dense layer's row kept
        assert x["bit_ok"] and (x["final"][0] == x["old"][0]).all()
        # (d) stall bound of the hooked on_forward_pass_end (upstream's dump_record all-reduce aside)
        assert max(x["own_s"]) < STALL_BOUND_S and h["start_s"] < STALL_BOUND_S
        # (f) the pass clock (hooked on_forward_pass_end): every pass the rebalance spanned, and the steady
        # passes before it, summarised for the log's "pass intervals" line
        during, before = h["passes_during"], h["passes_before"]
        assert during["n"] == h["gate_steps"] + h["migration_steps"]
        assert before["n"] >= REBALANCE_AFTER - 2
        # the same over decode passes only (5 in 7 here): the step time, passes that extend on any rank
        # left out
        dd, db = h["decode_passes_during"], h["decode_passes_before"]
        assert during["n"] * 5 // 7 - 2 <= dd["n"] <= during["n"] * 5 // 7 + 2
        assert before["n"] * 5 // 7 - 2 <= db["n"] <= before["n"] * 5 // 7 + 2
        for d in (during, before, dd, db):
            assert 0 < d["p50_ms"] <= d["p99_ms"] <= d["max_ms"] < 1e3
        assert 0 < h["boundary_work_mean_s"] <= h["boundary_work_max_s"] < STALL_BOUND_S  # logged in the end line
        assert 0 < h["switch_work_max_s"] <= h["boundary_work_max_s"]
        # (h) the dump the benchmark pools: every pass, labelled with its phase, our work and the switches
        d = x["dump"]
        assert d is not None and d["id"] == h["id"] and len(d["decode_during"]) == dd["n"]
        p = d["passes"]
        n = h["gate_steps"] + h["migration_steps"]
        steps = p.pop("placement_steps")
        assert set(p.pop("executor_build_ms")) == {"staging", "views_schedule"}
        assert all(len(v) == n for v in p.values())
        # with SGLANG_H20_EPLB_ASYNC_PEER=on the startup hook already tried to share the expert tensors for peer
        # copies (CPU tensors not in shared files: not possible on any rank, so every rank goes through gloo, the plan
        # keeps the configured launch mode, and the rebalance does not try again)
        assert res["startup_peers"] is None
        assert [x[0] for x in steps] == ["counts", "init_by_eplb", "agree", "plan", "to_devices", "executor"]
        assert h["pulled_bytes"] == 0 and h["received_bytes"] > 0
        assert all(0 <= a <= b for _, a, b in steps) and steps == [list(s) for s in h["placement_steps"]]
        assert steps[-1][2] < p["end_ms"][-1]  # on the passes' clock (ms from the job's start): placed before migrated
        assert p["end_ms"] == sorted(p["end_ms"]) and p["end_ms"][0] > 0
        # upstream's one-time empty_cache at the first dump was skipped
        assert x["first_dump_flag"] is False
        assert p["phase"] == ["placement"] * (h["gate_steps"] - 1) + ["start"] + ["migration"] * h["migration_steps"]
        assert sum(p["switch"]) == len(set(f.values())) and all(p["phase"][k] == "migration"
                                                                 for k in range(n) if p["switch"][k])
        # a progress line per switching pass while layers remain (the last switch ends the rebalance instead), then
        # the end line with the record's figures in its units
        progress = [m for m in x["lines"] if "switched after" in m]
        assert len(progress) == sum(p["switch"]) - 1, progress
        end = [m for m in x["lines"] if " end: " in m]
        assert len(end) == 1 and re.search(
            rf"end: {len(h['switched'])} layers switched over {n} forward passes \(placement {h['gate_steps']}, "
            rf"migration {h['migration_steps']}\); boundary work on the decode thread: "
            rf"mean {1e6 * h['boundary_work_mean_s']:.0f} us, max {1e3 * h['boundary_work_max_s']:.2f} ms "
            rf"\(at switches: max {1e3 * h['switch_work_max_s']:.2f} ms\); "
            rf"received {h['received_bytes'] / 1e9:.2f} GB", end[0]), end
        assert all(w is not None and 0 <= w < 1e6 * STALL_BOUND_S for w in p["work_us"])
        assert sum(p["decode"]) == dd["n"] and p["ms"] and min(p["ms"]) > 0
    assert all(f == flips[0] for f in flips)  # same step on every rank
    assert len(set(flips[0].values())) >= 2   # staging of one layer: layers switched at different steps
    assert min(flips[0].values()) > REBALANCE_AFTER + out[0][0]["history"][0]["gate_steps"]


def test_async_rebalance_placement_failure_aborts_before_transfers(world):
    codes, out = world
    end = set()
    for r in range(3):
        x = out[r][1]
        h = x["history"][1]
        assert h["outcome"] == "aborted" and "rank 2: placement failed" in h["error"]
        assert "migration_steps" in h and h["migration_steps"] == 0
        assert len(x["errors"]) == 1 and "before any transfer" in x["errors"][0]
        assert (x["labels"] == 0).all() and (x["final"] == x["old"]).all() and x["bit_ok"]
        assert max(x["own_s"]) < STALL_BOUND_S and x["gate_timeouts"] == 0
        end.add(x["end_step"])
    assert len(end) == 1, f"ranks aborted at different steps: {end}"


def test_async_rebalance_rank_killed_survivors_abort(world):
    codes, out = world
    assert codes[3] == 17 and 3 not in out
    end = set()
    for r in range(3):
        x = out[r][2]
        h = x["history"][2]
        assert h["outcome"] == "aborted" and h["error"] and h["switched"] == ()
        assert len(x["errors"]) == 1 and "aborted" in x["errors"][0]
        assert (x["labels"] == 0).all() and (x["final"] == x["old"]).all() and x["bit_ok"]
        assert (x["old"] == out[r][0]["final"]).all()  # the first rebalance's placement stays
        assert max(x["own_s"]) < STALL_BOUND_S and x["gate_timeouts"] == 0
        end.add(x["end_step"])
    # Consistency needs no layer to switch after the kill on any survivor (asserted above: nothing switched,
    # every survivor ends on the old placement). The abort step itself was once seen to differ between
    # survivors on a loaded 2-core CI box ({413, 437}; not reproduced in other runs): printed, not asserted.
    print(f"survivors' abort steps: {sorted(end)}")
    assert all(step is not None for step in end)


def test_map_peers_failure_leaves_the_mapping_to_the_first_rebalance(tmp_path, caplog):
    """The startup hook's mapping (`map_peers`) never fails the server: an error leaves st.peers unset (the first
    rebalance maps them then, or falls back to NCCL) with one WARNING line."""
    import torch.distributed as dist

    from sglang_h20.eplb import async_rebalance as ar

    def no_model():
        raise RuntimeError("model not loaded")

    mgr = types.SimpleNamespace(_get_model=no_model, _server_args=types.SimpleNamespace(nnodes=1))
    ar.map_peers(mgr)  # no process group yet: nothing to map with, nothing said
    assert ar._state(mgr).peers is ... and not caplog.records
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with caplog.at_level(logging.WARNING, logger="sglang_h20.eplb.async"):
            ar.map_peers(mgr)
    finally:
        dist.destroy_process_group()
    assert ar._state(mgr).peers is ...
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert "not mapped at startup" in caplog.records[0].getMessage()


def _dropped_rebalance(monkeypatch, passes: int):
    """Our rebalance generator with stand-ins for the job (gate says go at the 2nd boundary; the transfers never
    finish), dropped as SGLang's reset_generator drops it after `passes` boundaries: (state, history, closes)."""
    from sglang.srt.eplb import expert_distribution
    from sglang_h20.eplb import async_rebalance as ar

    closes = []

    class Executor:
        build_ms, status = {}, types.SimpleNamespace(state="running")

        def start(self):
            pass

        def maybe_switch(self):
            return []

        def close(self, timeout=None):
            closes.append(timeout)

    class Job:
        def __init__(self, manager, group, counts, ready, mid, mode, state):
            self.mid, self.launch, self.steps, self.t0 = mid, mode.launch, [], time.perf_counter()
            self.thread, self.stop = types.SimpleNamespace(start=lambda: None), threading.Event()
            answers = iter([None, ("go", "")])
            self.gate = types.SimpleNamespace(step=lambda: next(answers))
            self.executor = Executor()
            self.plan = types.SimpleNamespace(layers=[1], summary=lambda: "1 layer")

        def switch_rows(self, layers):
            pass

    dump = {"average_utilization_rate_over_window": 0.5, "logical_count": torch.ones(1, 4, 8)}
    recorder = types.SimpleNamespace(dump_record=lambda output_mode: dump)
    monkeypatch.setattr(expert_distribution, "get_global_expert_distribution_recorder", lambda: recorder)
    monkeypatch.setattr(ar, "_upstream_reason", lambda manager: None)
    monkeypatch.setattr(ar, "_new_group", lambda: "group-1")
    monkeypatch.setattr(ar, "_Job", Job)
    manager = types.SimpleNamespace(_check_rebalance_needed=lambda rate: True, _server_args=types.SimpleNamespace(),
                                    _get_model=lambda: types.SimpleNamespace(routed_experts_weights_of_layer={1: 0}))
    gen = ar._rebalance(None, manager, ar.Mode())
    for _ in range(passes):
        next(gen)
    gen.close()  # what dropping it does (GeneratorExit at the paused yield)
    return ar._state(manager), ar.history(manager), closes


def test_a_dropped_rebalance_closes_its_executor_and_sets_its_group_aside(monkeypatch):
    """Dropped mid-migration (SGLang's reset_generator, e.g. disable_rebalance): the executor is closed without
    waiting and its group, whose peers abort through their watchdog, is set aside for a new one."""
    st, hist, closes = _dropped_rebalance(monkeypatch, passes=4)
    assert [h["outcome"] for h in hist] == ["closed"] and hist[0]["gate_steps"] == 2
    assert closes == [0] and st.dead_groups == ["group-1"] and st.group is None and st.during is None


def test_a_rebalance_dropped_before_its_transfers_keeps_its_group(monkeypatch):
    """Dropped while the placement runs: no executor started, nothing to close; the group is still good."""
    st, hist, closes = _dropped_rebalance(monkeypatch, passes=1)
    assert [h["outcome"] for h in hist] == ["closed"] and hist[0]["gate_steps"] == 0
    assert closes == [] and st.dead_groups == [] and st.group == "group-1" and st.during is None


# ----------------------------------------------------------------------------- start gate (in-process)
def _gates(n=2, every=4, ahead=2):
    from sglang_h20.eplb.async_rebalance import _Gate

    store = torch.distributed.HashStore()
    return [_Gate(torch.distributed.PrefixStore("g/", store), n, every, ahead) for _ in range(n)]


def test_upstream_first_dump_still_empties_the_cache_behind_the_flag_we_clear():
    """`_skip_first_dump_empty_cache` clears SGLang's `_first_dump`: the installed SGLang must still have it."""
    from sglang.srt.eplb import expert_distribution as ed

    src = inspect.getsource(ed._StatAccumulator)
    assert "self._first_dump = True" in src and "if self._first_dump:" in src and "empty_cache()" in src


def test_gate_settles_missed_rounds_as_wait_then_all_go_at_one_boundary():
    g0, g1 = _gates()
    assert [g0.step() for _ in range(3)] == [None] * 3
    assert g0.step() == ("wait", "")          # round 0 reached, nobody proposed: settled as wait
    g1.propose("G:", threading.Event())       # round 0 is taken: lands in round 1 (boundary 8)
    seen0 = [g0.step() for _ in range(4)]
    seen1 = [g1.step() for _ in range(8)]
    assert seen0[-1] == ("go", "") and seen1[3] == ("wait", "") and seen1[7] == ("go", "")
    assert seen0[:3] == [None] * 3 and all(x is None for i, x in enumerate(seen1) if i not in (3, 7))


def test_gate_abort_reaches_every_rank_at_the_same_boundary():
    g0, g1 = _gates()
    g1.step()
    g1.propose("A:rank 1: placement failed", threading.Event())
    g0.propose("G:", threading.Event())       # too late: round 0 already holds the abort
    for g in (g0, g1):
        got = [g.step() for _ in range(4 - g.boundary)]
        assert got[-1] == ("abort", "rank 1: placement failed") and g.boundary == 4


def _step_time_benchmark(*args, timeout_s: float = 600) -> None:
    """benchmark/eplb/migration_step_time.py --device cpu in a session of its own; on a timeout the whole session
    (its spawned ranks too) is killed. Idle the --world 2 run takes ~4 s, with 16 busy loops beside it 35-66 s
    (the imports of 3 processes): the former 120 s timeout was under 2x that, and once it expired
    subprocess.run(capture_output=True) kept waiting for the orphaned ranks that held its pipes."""
    import signal
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    p = subprocess.Popen([sys.executable, "benchmark/eplb/migration_step_time.py", "--device", "cpu",
                          "--deadline-s", str(timeout_s - 60), *args], cwd=root, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        _, err = p.communicate()
        raise AssertionError(f"migration_step_time.py timed out after {timeout_s} s: {err.decode()[-2000:]}")
    assert p.returncode == 0, err.decode(errors="replace")[-3000:]


def test_step_time_benchmark_cpu_smoke(tmp_path):
    """benchmark/eplb/migration_step_time.py end to end on CPU (tiny shapes): both moves verified."""
    import json

    out = tmp_path / "r.json"
    _step_time_benchmark("--steady-steps", "20", "--launch", "thread", "--json", str(out))
    r = json.loads(out.read_text())
    p = r["presets"]["cpu-smoke"]
    assert r["launch"] == "thread"
    assert r["provenance"]["git_commit"] and p["ours"]["bit_identical"] and p["blocking"]["bit_identical"]
    assert p["ours"]["chunks"] == 3 and p["ours"]["migration_steps"] >= 3
    assert {"p50_ms", "p99_ms", "p99_over_steady_p50"} <= set(p["blocking"])


def test_step_time_benchmark_cpu_smoke_two_ranks(tmp_path):
    """The same benchmark with --world 2 (2 gloo processes, 1 node x 2 GPUs): experts move between the
    ranks (P2P) and inside them, both migrations land bit-identical on every rank."""
    import json

    out = tmp_path / "r.json"
    t0 = time.monotonic()
    _step_time_benchmark("--world", "2", "--steady-steps", "20", "--json", str(out))
    r = json.loads(out.read_text())
    p = r["presets"]["cpu-smoke"]
    print(f"\n--world 2 cpu-smoke: wall {time.monotonic() - t0:.1f} s, ours {p['ours']}")
    assert r["world"] == 2 and p["ours"]["bit_identical"] and p["blocking"]["bit_identical"]
    assert p["ours"]["chunks"] == 3 and p["ours"]["migration_steps"] >= 3
    for k in ("ours", "blocking"):
        assert p[k]["bytes_cross_gpu_gb"] > 0 and p[k]["bytes_local_gb"] > 0
        assert {"p50_ms", "p99_ms", "max_ms", "p99_over_steady_p50"} <= set(p[k])
    assert p["ours"]["bytes_cross_gpu_gb"] + p["ours"]["bytes_local_gb"] == pytest.approx(p["ours"]["bytes_copied_gb"])


def test_the_steady_window_keeps_steady_passes_intervals(monkeypatch):
    """Before a rebalance a rank keeps the last TUNING.steady_passes pass intervals (that many + 1 boundaries) as the
    steady reference its p99 is compared with: no more, however long the server ran."""
    from types import SimpleNamespace as NS

    from sglang_h20.eplb import async_rebalance as ar

    monkeypatch.setattr(ar.TUNING, "steady_passes", 5)
    manager = NS()
    for _ in range(12):
        ar.after_pass(None, manager)
    st = ar._state(manager)
    assert len(st.pass_ends) == 6 and len(ar.pass_intervals(st.pass_ends)) == 5


def test_pass_intervals_leave_idle_gaps_out_and_summaries_use_nearest_rank():
    from sglang_h20.eplb import async_rebalance as ar

    ends = [(0.0, None), (0.010, True), (0.020, True), (0.035, False), (5.0, True), (5.012, True)]
    ms = ar.pass_intervals(ends)  # 10, 10, 15 ms (a prefill pass), an idle gap of ~5 s, 12 ms
    assert [round(x, 6) for x in ms] == [10.0, 10.0, 15.0, 12.0]
    assert [round(x, 6) for x in ar.pass_intervals(ends, decode_only=True)] == [10.0, 10.0, 12.0]
    # decode passes after a decode pass: not the first (its previous pass is unknown), not the idle gap
    assert [round(x, 6) for x in ar.pass_intervals(ends, decode_only=True, after_decode=True)] == [10.0, 12.0]
    s = ar.interval_summary(ms)
    assert s["n"] == 4 and round(s["p50_ms"], 6) == 10.0 and round(s["p99_ms"], 6) == 15.0 == round(s["max_ms"], 6)
    assert ar.interval_summary([]) == {"n": 0}
    xs = [float(i) for i in range(1, 201)]  # nearest rank: p99 of 1..200 is 198, p50 is 100
    s = ar.interval_summary(xs)
    assert (s["p50_ms"], s["p99_ms"], s["max_ms"]) == (100.0, 198.0, 200.0)


def test_rebalance_passes_line_up_each_pass_with_its_phase_and_work():
    from sglang_h20.eplb import async_rebalance as ar

    spanned = [(10.000, True), (10.010, True), (10.030, False), (10.041, True)]  # three passes
    p = ar.rebalance_passes(spanned, [5e-6, 7e-6, 9e-6, 1.0], gate_steps=2, switch_at={2}, t_ref=9.5)
    assert p["ms"] == [10.0, 20.0, 11.0]
    assert p["end_ms"] == [510.0, 530.0, 541.0]  # after the job's creation, one per pass
    assert p["decode"] == [True, False, True]
    assert p["phase"] == ["placement", "start", "migration"]
    assert p["work_us"] == [5.0, 7.0, 9.0]  # the work of passes past the span is not counted
    assert p["switch"] == [False, False, True]


def test_rebalances_upstream_must_run_are_named_and_warned_once(monkeypatch, caplog):
    """Where upstream's own checks would refuse or redirect a rebalance (no metadata, a world its EP size does not
    span), ours hands it to upstream: one warning per reason; upstream's own "disabled" is logged by upstream."""
    import torch.distributed as dist
    from sglang.srt.elastic_ep.elastic_ep import ElasticEPStateManager
    from sglang.srt.eplb import expert_location

    from sglang_h20.eplb import async_rebalance as ar

    meta = [None]
    monkeypatch.setattr(ElasticEPStateManager, "instance", classmethod(lambda cls: None))
    monkeypatch.setattr(expert_location, "get_global_expert_location_metadata", lambda: meta[0])
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    manager = types.SimpleNamespace(_rebalance_disabled_reason=None, _server_args=types.SimpleNamespace(nnodes=2))
    assert ar._upstream_reason(manager) == "ep_size None != world size 4"
    meta[0] = types.SimpleNamespace(ep_size=2)
    assert ar._upstream_reason(manager) == "ep_size 2 != world size 4"
    meta[0] = types.SimpleNamespace(ep_size=4)
    assert ar._upstream_reason(manager) is None
    manager._server_args.nnodes = 3
    assert ar._upstream_reason(manager) == "ep_size not divisible by nnodes"

    ran = []

    def upstream(mgr, *a, **k):
        ran.append(a)
        yield "upstream"

    caplog.set_level(logging.WARNING, logger=ar.log.name)
    for _ in range(2):
        assert list(ar._rebalance(upstream, manager, None, 7)) == ["upstream"]
    manager._rebalance_disabled_reason = "off"
    assert ar._upstream_reason(manager) == "disabled"
    assert list(ar._rebalance(upstream, manager, None, 8)) == ["upstream"]
    assert ran == [(7,), (7,), (8,)]
    warned = [r.getMessage() for r in caplog.records if "runs upstream" in r.getMessage()]
    assert warned == ["eplb_async: ep_size not divisible by nnodes: this rebalance runs upstream (blocking)"]


def test_migration_group_nccl_options_cap_ctas(monkeypatch):
    """The migration group's NCCL kernels take at most TUNING.nccl_max_ctas SMs beside decode; None: NCCL's own."""
    from sglang_h20.eplb import async_rebalance as ar

    assert ar.nccl_options().config.max_ctas == ar.TUNING.nccl_max_ctas == 4
    monkeypatch.setattr(ar.TUNING, "nccl_max_ctas", None)
    assert ar.nccl_options() is None


def test_dump_intervals_writes_what_the_benchmark_pools(tmp_path, caplog):
    """A rebalance's raw intervals land where affinity_remote_share.pooled_decode_p99 reads them: per rank, every
    pass and decode passes, during and before; an unwritable folder costs a warning, not the rebalance."""
    import json

    from sglang_h20.eplb import async_rebalance as ar

    ends = lambda t0, n, decode: [(t0 + 0.005 * i, decode(i)) for i in range(n)]
    before = ends(0.0, 200, lambda i: i % 5 != 0)
    during = ends(10.0, 120, lambda i: True)
    ar.dump_intervals(str(tmp_path / "d"), "r7", ar.rebalance_intervals(during, before))
    rec = json.loads((tmp_path / "d" / "eplb_async_r7_rank0.json").read_text())
    assert rec["id"] == "r7" and rec["rank"] == 0
    assert len(rec["all_before"]) == 199 and 150 <= len(rec["decode_before"]) <= 161
    assert len(rec["all_during"]) == len(rec["decode_during"]) == len(rec["decode_after_decode_during"]) == 119
    assert 110 <= len(rec["decode_after_decode_before"]) <= 122  # decode passes after a decode pass: ~3 in 5
    assert all(abs(x - 5.0) < 1e-6 for x in rec["all_during"])
    (tmp_path / "file").write_text("")
    with caplog.at_level(logging.WARNING, logger="sglang_h20.eplb.async"):
        ar.dump_intervals(str(tmp_path / "file"), "r8", {})  # a file where the folder should be: warns
    warned = [r.getMessage() for r in caplog.records if r.name == "sglang_h20.eplb.async"]
    assert len(warned) == 1 and warned[0].startswith("eplb_async: pass intervals of r8 not written to "), warned


def test_throttle_pauses_only_inside_bursts_and_sets_no_profile_hook():
    """`throttle`: inside `bursts` a pace point past the burst sleeps (so a decode thread beside the placement thread
    is not kept waiting for the GIL); outside it, and on other threads, points do nothing; no profile function is set
    (one on any thread slows every thread's Python), also not after an error."""
    from sglang_h20.eplb import throttle

    def points(n):
        for _ in range(n):
            throttle.point()

    t = time.perf_counter()
    with throttle.bursts(burst_s=0.0, pause_s=0.002):
        assert sys.getprofile() is None
        points(10)
        other = threading.Thread(target=points, args=(1000,))  # another thread's points: not throttled
        t_other = time.perf_counter()
        other.start()
        other.join()
        assert time.perf_counter() - t_other < 0.5
    assert time.perf_counter() - t >= 10 * 0.002  # one pause per point past the (zero) burst
    t = time.perf_counter()
    points(1000)  # outside a bursts block
    with throttle.bursts(burst_s=10.0, pause_s=1.0):  # a long burst: no pause within it
        points(1000)
    assert time.perf_counter() - t < 0.5
    with pytest.raises(ValueError):
        with throttle.bursts(burst_s=0.0, pause_s=0.0):
            raise ValueError("placement failed")
    t = time.perf_counter()
    points(100)  # the failed block left nothing behind
    assert time.perf_counter() - t < 0.5 and sys.getprofile() is None


@pytest.mark.parametrize("algorithm,groups", [("deepseek", None), ("deepseek_hierarchical", 4), ("auto", 4)])
def test_layered_placement_equals_upstream_init_by_eplb(monkeypatch, algorithm, groups):
    """`place_layered` (one layer per algorithm call, pace points between) gives upstream init_by_eplb's metadata,
    every routing field, for the deepseek algorithms (flat and hierarchical over 2 nodes)."""
    from types import SimpleNamespace as NS

    from sglang.srt import runtime_context as rc
    from sglang.srt.eplb import expert_location as el
    from sglang_h20.eplb import async_rebalance as ar
    from sglang_h20.eplb import throttle

    exe = NS(moe=NS(ep_num_redundant_experts=REDUNDANT, ep_dispatch_algorithm="dynamic", moe_a2a_backend="none",
                    ep_join_mode="none"))
    monkeypatch.setattr(rc, "get_exec", lambda: exe)
    monkeypatch.setattr(rc, "get_parallel", lambda: NS(ep_size=WORLD, nnodes=2, elastic_ep_initial_size=None,
                                                       max_ep_size=None))
    monkeypatch.setattr(el.ModelConfigForExpertLocation, "from_model_config",
                        staticmethod(lambda mc: el.ModelConfigForExpertLocation(NUM_LAYERS, E, groups)))
    args = NS(eplb_algorithm=algorithm, device="cpu", nnodes=2, tp_size=WORLD, ep_size=WORLD)
    rng = np.random.default_rng(3)
    counts = torch.tensor(np.stack([rng.permutation(E) * 7 + rng.integers(1, 7, E) for _ in range(NUM_LAYERS)]))
    counts[0, 0] = 1000  # layer 0's hot expert gets more replicas than any other: the other layers are padded
    want = el.ExpertLocationMetadata.init_by_eplb(args, None, counts)
    assert want.logical_to_all_physical_map_num_valid.max(dim=-1).values.unique().numel() > 1
    with throttle.bursts(burst_s=0.0, pause_s=0.0):
        got = ar.place_layered(args, None, counts)
    assert ar._layer_by_layer(args)
    for f in ar.ROUTING_FIELDS + ("ep_size",):
        a, b = getattr(want, f), getattr(got, f)
        if isinstance(a, torch.Tensor):
            assert a.shape == b.shape and torch.equal(a.cpu(), b.cpu()), f
        else:
            assert a == b, f


def test_shuffled_placement_moves_most_slots_the_same_way_on_every_rank(monkeypatch):
    """SGLANG_H20_EPLB_ASYNC_SHUFFLE (benchmarks): each MoE layer's slots permuted by a seed from the rebalance id,
    so every rank gets the same placement; the derived routing maps agree with it; other layers are untouched."""
    from types import SimpleNamespace as NS

    from sglang.srt import runtime_context as rc
    from sglang.srt.eplb.expert_location import ExpertLocationMetadata
    from sglang_h20.eplb import async_rebalance as ar
    from sglang_h20.eplb.integration import sglang_maps

    exe = NS(moe=NS(ep_num_redundant_experts=REDUNDANT, ep_dispatch_algorithm="dynamic", moe_a2a_backend="none",
                    ep_join_mode="none"))
    monkeypatch.setattr(rc, "get_exec", lambda: exe)
    rng = np.random.default_rng(7)
    rows = np.stack([np.concatenate([rng.permutation(E), rng.integers(0, E, REDUNDANT)]) for _ in range(NUM_LAYERS)])
    p2l, log2phy, _ = sglang_maps(rows, E)
    meta = ExpertLocationMetadata._init_raw(ep_size=WORLD, physical_to_logical_map=p2l,
                                            logical_to_all_physical_map=log2phy)
    a, b, c = (ar.shuffled(meta, MOE, mid) for mid in ("r1", "r1", "r2"))
    new = a.physical_to_logical_map_cpu.numpy()
    assert (new == b.physical_to_logical_map_cpu.numpy()).all()          # same id: same placement on every rank
    assert not (new == c.physical_to_logical_map_cpu.numpy()).all()      # the next rebalance moves again
    assert (new[0] == rows[0]).all()                                      # a layer not listed stays
    for l in MOE:
        assert sorted(new[l]) == sorted(rows[l])                          # same replicas per expert
        assert (new[l] != rows[l]).mean() >= 0.5                          # most slots move
        for e in range(E):                                                # routing maps derived from the new rows
            slots = [s for s in a.logical_to_all_physical_map_cpu[l, e].tolist() if s >= 0]
            assert sorted(slots) == [s for s in range(new.shape[1]) if new[l, s] == e]
        assert a.logical_to_all_physical_map_num_valid[l].tolist() == [int((new[l] == e).sum()) for e in range(E)]


def test_placement_interference_bench_runs_on_the_cpu(tmp_path):
    """benchmark/eplb/placement_interference.py without a GPU: the step's GPU part is a sleep, CPU actions only; the
    throttled action does its 20 ms of CPU work in bursts, so it takes several times as long."""
    import importlib.util

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmark" / "eplb" / "placement_interference.py"
    spec = importlib.util.spec_from_file_location("placement_interference", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "pi.json"
    assert bench.main(["--cpu", "--steps", "15", "--repeats", "1", "--switch-intervals", "5e-3", "--actions", "none",
                       "python_20ms_throttled", "gpu_alloc", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    rows = {r["action"]: r for r in rec["rows"]}
    assert set(rows) == {"none", "python_20ms_throttled"}  # gpu_alloc needs a GPU: left out
    assert rows["python_20ms_throttled"]["action_ms"] >= 40.0 and rows["none"]["action_ms"] < 5.0
    assert all(0 < r["p50_ms"] <= r["max_ms"] for r in rows.values()) and rec["args"]["cpu"] is True


def test_the_step_time_benchmarks_slot_check_tail_ratios_and_draws():
    """migration_step_time's verdict 'bit_identical' rests on moved_ok: a slot must now hold what the slot of its new
    expert held before. A right move passes; a slot left unmoved, two swapped, or one wrong layer of two fails. Its
    window statistics and tail ratios have worked values, and the stored runs' ratios are those of their own
    figures. Its re-placement draws are derangements: every slot gets another expert."""
    from repo_scripts import RESULTS, load_script

    step_time = load_script("benchmark/eplb/migration_step_time.py")
    old = {0: [5, 6, 7], 1: [5, 6, 7]}  # slot s of layer l holds expert old[l][s]
    new = {0: [7, 5, 6], 1: [6, 7, 5]}
    before = {0: torch.tensor([50, 60, 70]), 1: torch.tensor([51, 61, 71])}  # each slot's fingerprint
    right = {0: torch.tensor([70, 50, 60]), 1: torch.tensor([61, 71, 51])}
    assert step_time.moved_ok(before, right, old, new)
    for wrong in ({0: before[0], 1: right[1]}, {0: torch.tensor([50, 70, 60]), 1: right[1]},
                  {0: right[0], 1: torch.tensor([61, 51, 71])}):
        assert not step_time.moved_ok(before, wrong, old, new)
    assert step_time.stats([1.0, 2.0, 3.0, 4.0, 100.0]) == pytest.approx(
        {"steps": 5, "p50_ms": 3.0, "p99_ms": 4.0 + 0.96 * 96.0, "max_ms": 100.0, "mean_ms": 22.0})
    assert step_time.over_steady({"p99_ms": 21.0, "max_ms": 30.0}, {"p50_ms": 20.0, "p99_ms": 20.5}) == pytest.approx(
        {"p99_over_steady_p50": 1.05, "p99_over_steady_p99": 21.0 / 20.5, "max_over_steady_p50": 1.5})
    windows = 0  # the stored H200 runs' ratios are these of their own figures
    for path in sorted((RESULTS / "eplb").glob("migration_step_time*.json")):
        for preset in json.loads(path.read_text())["presets"].values():
            for k in ("ours", "blocking"):
                if "p99_over_steady_p50" in preset.get(k, {}):
                    got = step_time.over_steady(preset[k], preset["steady"])
                    assert got == pytest.approx({r: preset[k][r] for r in got}, rel=1e-12), (path.name, k)
                    windows += 1
    assert windows == 14
    rng = np.random.default_rng(3)
    for n in (2, 3, 8, 64):
        for _ in range(20):
            p = step_time.derangement(rng, n)
            assert sorted(p.tolist()) == list(range(n)) and not (p == np.arange(n)).any()
