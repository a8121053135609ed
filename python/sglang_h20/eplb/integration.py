"""The eplb feature inside SGLang 0.5.17: record co-activation on the GPU, place by affinity.

Hook points (all checked by tests against the installed sglang):

record   `sglang.srt.layers.moe.topk._post_process_topk_ids` (BEFORE). It is the one place in
         `select_experts` that has the layer id, the *logical* top-k ids (before the EPLB
         logical->physical remap), `num_token_non_padded` (padded CUDA-graph or DP rows are not
         masked yet, so we mask them), and `topk_config.allow_routed_experts_capture` (False on
         MTP/draft layers, which we therefore skip). SGLang's own `on_select_experts` is called
         later with *physical* ids, and without its recorder enabled it has no layer context
         (`with_current_layer` is a no-op in the Noop recorder), so it cannot be reused.
         Not covered: BYPASSED top-k formats (flashinfer-trtllm routing inside the MoE kernel),
         which never materialise top-k ids.
window   `..._ExpertDistributionRecorderReal.with_forward_pass` (BEFORE). It runs once per real
         forward pass, never in CUDA-graph warm-up or capture. We record exactly while SGLang's
         recorder records. A start (False->True) resets our counts, as SGLang's start_record
         does. Before the first real pass the recorder is inactive, so warm-up routing is not counted.
sampling `sglang.srt.eplb.eplb_manager.EPLBManager.on_forward_pass_end` (BEFORE): one step() per
         target forward pass (the draft runner has no EPLB manager, so MTP passes do not shift
         the sampling phase). This is the same clock that EPLB's rebalance interval counts.
snapshot `..._ExpertDistributionRecorderReal.dump_record` (AFTER). SGLang all-reduces its
         logical counts there on every rank, both for EPLB's rebalance and for the
         /dump_expert_distribution_record endpoint. We all-reduce our counts at the same
         collective point, keep the result as the latest snapshot (identical on every rank, so
         every rank computes the same placement), and reset, like SGLang. In file mode rank 0
         also writes `coactivation_<time>.npz` next to SGLang's dump.
algorithm `sglang.srt.eplb.eplb_algorithms.compute_algorithm` (AROUND): `--eplb-algorithm affinity`
         parses to AFFINITY_ALGORITHM instead of raising KeyError.
placement `sglang.srt.eplb.eplb_algorithms.rebalance_experts` (AROUND). With the feature on (or
         --eplb-algorithm affinity), it calls `placement.place(snapshot, topology, "affinity")`
         and returns SGLang's (phy2log, log2phy, logcnt). Without a usable snapshot it falls
         back to the upstream algorithm and logs one line. elasticity_aware* stays upstream,
         because it needs the live-rank mask.

Counts are summed over all ranks, as SGLang sums its logical counts. Without DP attention every
TP rank sees the same tokens, which scales all counts by the same factor.
"""
from __future__ import annotations

import inspect
import logging
import time
from pathlib import Path

import numpy as np
import torch

from sglang_h20.eplb.recorder import CoactivationRecorder, _capturing
from sglang_h20.eplb.stats import CoactivationStats
from sglang_h20.features import Hook
from sglang_h20.logonce import OnceLog
from sglang_h20.settings import Settings

log = logging.getLogger("sglang_h20.eplb")

TOPK_MODULE = "sglang.srt.layers.moe.topk"
DIST_RECORDER = "sglang.srt.eplb.expert_distribution._ExpertDistributionRecorderReal"
ALGO_MODULE = "sglang.srt.eplb.eplb_algorithms"

RECORD_TARGET = TOPK_MODULE + "._post_process_topk_ids"
FORWARD_PASS_TARGET = DIST_RECORDER + ".with_forward_pass"
STEP_TARGET = "sglang.srt.eplb.eplb_manager.EPLBManager.on_forward_pass_end"
DUMP_TARGET = DIST_RECORDER + ".dump_record"
COMPUTE_ALGORITHM_TARGET = ALGO_MODULE + ".compute_algorithm"
REBALANCE_TARGET = ALGO_MODULE + ".rebalance_experts"
RUNNER_INIT_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.initialize"

# Parameter order of _post_process_topk_ids in sglang 0.5.17 (a test compares it with the real one).
POST_PROCESS_PARAMS = ("topk_ids", "topk_weights", "topk_config", "router_logits", "layer_id",
                       "num_token_non_padded", "expert_location_dispatch_info")
SAMPLE_EVERY = 1  # record every step; raise to trade statistics for eager-mode time
PLACE_ALGORITHM = "affinity"


class _AffinityAlgorithm:
    """What `compute_algorithm("affinity", ...)` returns; only our rebalance wrapper accepts it."""

    name = "affinity"

    def __repr__(self) -> str:
        return "EplbAlgorithm.affinity (sglang-h20)"


AFFINITY_ALGORITHM = _AffinityAlgorithm()


class _State:
    def __init__(self):
        self.recorder: CoactivationRecorder | None = None
        self.active_wanted = False  # follows SGLang's recorder; False until the first real pass
        self.disabled: str | None = None  # why recording stopped in this process
        self.latest: CoactivationStats | None = None
        self.warned: set[str] = set()


_state = _State()


def _warn_once(key: str, msg: str, *args) -> None:
    if key not in _state.warned:
        _state.warned.add(key)
        log.warning(msg, *args)


def get_recorder() -> CoactivationRecorder | None:
    return _state.recorder


def latest_snapshot() -> CoactivationStats | None:
    """The last all-reduced snapshot (what the next rebalance places with), or None."""
    return _state.latest


def set_latest_snapshot(stats: CoactivationStats | None) -> None:
    """Seed or clear the snapshot, e.g. from a file written by a previous run."""
    _state.latest = stats


def reset_state() -> None:
    """Forget the recorder and snapshot of this process (tests)."""
    global _state
    _state = _State()


def _new_recorder(num_layers: int, num_experts: int, device) -> CoactivationRecorder:
    rec = CoactivationRecorder(num_layers, num_experts, device, sample_every=SAMPLE_EVERY)
    rec.set_active(_state.active_wanted)
    _state.recorder = rec
    log.info("co-activation recorder: %d layers x %d experts on %s (%.0f MiB), sample every %d step(s)",
             num_layers, num_experts, rec.device, rec.acc.nbytes / 2**20, SAMPLE_EVERY)
    return rec


def _metadata_shape() -> tuple[int, int] | None:
    from sglang.srt.eplb.expert_location import get_global_expert_location_metadata

    m = get_global_expert_location_metadata()
    return None if m is None else (m.num_layers, m.num_logical_experts)


def _recorder_for(device: torch.device) -> CoactivationRecorder | None:
    if _state.recorder is not None:
        return _state.recorder
    if _state.disabled is not None:
        return None
    shape = _metadata_shape()
    if shape is None:
        _state.disabled = "SGLang has no expert-location metadata for this model"
        _warn_once("no-metadata", "co-activation recorder off: %s", _state.disabled)
        return None
    if _capturing(device):
        # Allocating (and zero-filling) inside a capture would bind the counts to the graph pool.
        _warn_once("capture-first", "co-activation recorder: first routing seen inside CUDA-graph "
                   "capture, not recorded in that graph (SGLang normally warms up first)")
        return None
    return _new_recorder(*shape, device)


# ----------------------------------------------------------------------------- hook functions
def on_post_process_topk_ids(*args, **kwargs):
    """BEFORE _post_process_topk_ids: record the logical top-k ids of this layer. Never raises."""
    try:
        a = dict(zip(POST_PROCESS_PARAMS, args))
        a.update(kwargs)
        topk_ids, layer_id, cfg = a.get("topk_ids"), a.get("layer_id"), a.get("topk_config")
        if topk_ids is None or layer_id is None:
            return None
        if cfg is not None and not getattr(cfg, "allow_routed_experts_capture", True):
            return None  # draft/MTP layers: not the served model's routing
        rec = _recorder_for(topk_ids.device)
        if rec is None or _state.disabled is not None or not 0 <= layer_id < rec.num_layers:
            return None
        rec.record(layer_id, topk_ids, a.get("num_token_non_padded"))
    except Exception as e:  # recording must never break serving
        _state.disabled = f"{type(e).__name__}: {e}"
        _warn_once("record-error", "co-activation recorder off after an error: %s", _state.disabled)
    return None


def _hook_failed(where: str, e: Exception) -> None:
    _state.disabled = f"{where}: {type(e).__name__}: {e}"
    _warn_once("hook-error-" + where, "co-activation recorder off after an error in %s: %s: %s",
               where, type(e).__name__, e)


def on_forward_pass(recorder_self, *args, **kwargs):
    """BEFORE with_forward_pass: record exactly while SGLang's expert-distribution recorder records."""
    try:
        want = bool(getattr(recorder_self, "recording", False))
        rec = _state.recorder
        if rec is not None:
            if want and not _state.active_wanted:
                rec.reset()  # a new window, as SGLang's start_record resets its own counts
            rec.set_active(want)
        _state.active_wanted = want
    except Exception as e:
        _hook_failed("with_forward_pass", e)
    return None


def on_forward_pass_end(*args, **kwargs):
    """BEFORE EPLBManager.on_forward_pass_end: advance the sampling step (target passes only)."""
    try:
        if _state.recorder is not None:
            _state.recorder.step()
    except Exception as e:
        _hook_failed("on_forward_pass_end", e)
    return None


def after_dump_record(result, recorder_self, *args, **kwargs):
    """AFTER dump_record: all-reduce our counts at SGLang's collective point, keep, reset."""
    try:
        _snapshot_after_dump(recorder_self, kwargs.get("output_mode", args[0] if args else "file"))
    except Exception as e:  # the next rebalance then falls back to upstream (or an older snapshot)
        _hook_failed("dump_record", e)
    return None


def _snapshot_after_dump(recorder_self, output_mode) -> None:
    rec = _state.recorder
    if rec is None:  # every rank must join the all-reduce with the same shape
        m = recorder_self._expert_location_metadata
        rec = _new_recorder(m.num_layers, m.num_logical_experts, m.physical_to_logical_map.device)
    stats = rec.snapshot(all_reduce=True)
    rec.reset()
    _state.latest = stats
    log.info("co-activation snapshot: %d tokens over %d layers x %d experts",
             stats.tokens, stats.num_layers, stats.num_experts)
    if output_mode == "file" and _rank() == 0:
        try:
            from sglang.srt.environ import envs

            d = Path(envs.SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR.get())
            d.mkdir(parents=True, exist_ok=True)
            path = stats.save(d / f"coactivation_{time.time()}.npz")
            log.info("co-activation written to %s", path)
        except Exception as e:
            log.warning("co-activation dump failed: %s: %s", type(e).__name__, e)


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def around_compute_algorithm(original, *args, **kwargs):
    """`--eplb-algorithm affinity` -> AFFINITY_ALGORITHM; every other value as upstream."""
    raw = kwargs.get("raw_algorithm", args[0] if args else None)
    if raw == AFFINITY_ALGORITHM.name:
        return AFFINITY_ALGORITHM
    return original(*args, **kwargs)


# ----------------------------------------------------------------------------- placement
def sglang_maps(phy2log, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """phy2log [L, S] -> SGLang's (phy2log [L, S], log2phy [L, E, R], logcnt [L, E]), int64, CPU.

    R = the largest replica count over all layers. log2phy[l, e] lists the slots of expert e in
    ascending slot order, padded with -1, which is the layout of the deepseek algorithm's output.
    Raises ValueError when an id is out of range or a logical expert has no replica.
    """
    p2l = torch.as_tensor(np.asarray(phy2log), dtype=torch.int64).cpu()
    if p2l.dim() != 2:
        raise ValueError(f"phy2log must be [L, S], got shape {tuple(p2l.shape)}")
    L, S = p2l.shape
    if S and (p2l.min() < 0 or p2l.max() >= num_experts):
        raise ValueError(f"phy2log holds ids outside [0, {num_experts})")
    logcnt = torch.zeros((L, num_experts), dtype=torch.int64)
    logcnt.scatter_add_(1, p2l, torch.ones_like(p2l))
    if (logcnt < 1).any():
        layer, expert = (logcnt < 1).nonzero()[0].tolist()
        raise ValueError(f"layer {layer}: logical expert {expert} has no replica")
    maxcnt = int(logcnt.max())
    order = torch.argsort(p2l, dim=1, stable=True)  # slots grouped by expert, ascending slot
    first = torch.cumsum(logcnt, dim=1) - logcnt  # position of each expert's first slot in `order`
    rank_sorted = torch.arange(S).expand(L, S) - first.gather(1, p2l.gather(1, order))
    rank = torch.empty_like(p2l).scatter_(1, order, rank_sorted)
    log2phy = torch.full((L, num_experts, maxcnt), -1, dtype=torch.int64)
    log2phy.view(L, -1).scatter_(1, p2l * maxcnt + rank, torch.arange(S).expand(L, S))
    return p2l, log2phy, logcnt


def _is_elasticity_aware(algorithm) -> bool:
    return str(getattr(algorithm, "name", "")).startswith("elasticity_aware")


def make_rebalance_wrapper(settings: Settings):
    on_by_switch = settings["eplb"] == "affinity"
    affinity = settings["eplb_affinity"]

    def around_rebalance_experts(original, *args, **kwargs):
        b = inspect.signature(original).bind(*args, **kwargs)
        b.apply_defaults()
        a = dict(b.arguments)
        algorithm = a["algorithm"]
        chosen = algorithm is AFFINITY_ALGORITHM
        if not (chosen or on_by_switch):
            return original(*args, **kwargs)
        if _is_elasticity_aware(algorithm):
            log.info("eplb: %s keeps SGLang's placement (it needs the live-rank mask)", algorithm.name)
            return original(*args, **kwargs)

        def upstream(why: str):
            if chosen:  # our sentinel: hand upstream what "auto" would have picked
                from sglang.srt.eplb import eplb_algorithms

                a["algorithm"] = eplb_algorithms.compute_algorithm(
                    raw_algorithm="auto", num_groups=a["num_groups"], num_nodes=a["num_nodes"])
            log.info("eplb affinity: %s, using SGLang's %s placement", why, a["algorithm"].name)
            return original(**a)

        try:
            result = _affinity_rebalance(_state.latest, a, affinity)
        except _Fallback as f:
            return upstream(str(f))
        except Exception as e:  # a broken placement must not take the server down
            return upstream(f"placement failed ({type(e).__name__}: {e})")
        log.info("eplb affinity: placed %d layers x %d slots from %d recorded tokens",
                 result[0].shape[0], result[0].shape[1], _state.latest.tokens)
        return result

    return around_rebalance_experts


class _Fallback(Exception):
    pass


def _affinity_rebalance(stats: CoactivationStats | None, a: dict, affinity: float):
    tokens_per_expert = a["tokens_per_expert"]
    num_phy, num_local, num_nodes = a["num_physical_experts"], a["num_local_physical_experts"], a["num_nodes"]
    L, E = tuple(tokens_per_expert.shape[-2:])
    if stats is None:
        raise _Fallback("no co-activation snapshot yet")
    if stats.tokens <= 0:
        raise _Fallback("the co-activation snapshot holds no tokens")
    if (stats.num_layers, stats.num_experts) != (L, E):
        raise _Fallback(f"snapshot is {stats.num_layers} layers x {stats.num_experts} experts, "
                        f"SGLang asks for {L} x {E}")
    if num_local <= 0 or num_phy % num_local or (num_phy // num_local) % num_nodes:
        raise _Fallback(f"{num_phy} slots, {num_local} per GPU, {num_nodes} node(s) is no N x G x S layout")
    from sglang_h20.eplb import placement

    place = getattr(placement, "place", None)
    if place is None:
        raise _Fallback("sglang_h20.eplb.placement.place is not in this build")
    num_gpus = num_phy // num_local
    topo = placement.Topology(num_nodes=num_nodes, gpus_per_node=num_gpus // num_nodes, slots_per_gpu=num_local)
    result = place(stats, topo, PLACE_ALGORITHM, affinity=affinity)
    phy2log = np.asarray(result.phy2log)
    if phy2log.shape != (L, num_phy):
        raise ValueError(f"place returned phy2log {phy2log.shape}, expected {(L, num_phy)}")
    return sglang_maps(phy2log, E)


# ----------------------------------------------------------------------------- feature entry
def eplb_off_check(note, what: str) -> Hook:
    """AFTER ModelRunner.initialize: `note` (a feature's OnceLog) gets one line when this target runner has no EPLB
    manager, i.e. SGLang's EPLB is off (no --enable-eplb): no rebalance ever runs, so `what` never happens either."""

    def check(result, runner, *args, **kwargs) -> None:
        if not getattr(runner, "is_draft_worker", False) and getattr(runner, "eplb_manager", None) is None:
            note(f"SGLang's EPLB is off in this server (no --enable-eplb), so {what}")
        return None

    return Hook(RUNNER_INIT_TARGET, check, "after")


_note = OnceLog(log, "eplb: ")


def hooks(settings: Settings) -> list[Hook]:
    """The eplb feature's whole patch surface (empty when the switch is off)."""
    if settings["eplb"] != "affinity":
        return []
    return [
        Hook(RECORD_TARGET, on_post_process_topk_ids, "before"),
        Hook(FORWARD_PASS_TARGET, on_forward_pass, "before"),
        Hook(STEP_TARGET, on_forward_pass_end, "before"),
        Hook(DUMP_TARGET, after_dump_record, "after"),
        Hook(COMPUTE_ALGORITHM_TARGET, around_compute_algorithm, "around"),
        Hook(REBALANCE_TARGET, make_rebalance_wrapper(settings), "around"),
        eplb_off_check(_note, "no affinity placement is made (co-activation is still recorded whenever SGLang's "
                              "expert-distribution recorder records)"),
    ]
