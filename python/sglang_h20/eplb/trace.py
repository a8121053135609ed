"""Routing traces for the EPLB simulator: synthetic generators and SGLang's per-token dumps.

A trace is a sequence of steps (forward passes); each step is an int64 array topk_ids [L, T, K]
of logical expert ids, K distinct experts per token (ids < 0 are padding and ignored).

Synthetic model (per layer, independently):
  * popularity: Zipf-like, p(rank r) ~ r ** -skew over the layer's experts, with a different
    random ranking in every layer;
  * drift: each expert carries a latent score that takes a Gaussian random walk of std `drift`
    per step (scores start ~ N(0, 1)); an expert's popularity is the Zipf value of its score's
    rank, so the skew stays constant while which experts are hot changes slowly;
  * co-activation clusters (`clusters` = number of clusters): experts are randomly partitioned
    into equal clusters (e.g. 16 clusters of 16 experts). A token picks one cluster with
    probability proportional to the cluster's total popularity; each of its K experts comes from
    that cluster with probability `cluster_strength` (drawn by popularity, without replacement),
    the rest from the global popularity (without replacement, excluding the ones already taken).
    The partition is fixed over time; only popularity drifts. `clusters=None`: no structure,
    every token draws its K experts from the global popularity alone.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator

import numpy as np


def zipf_weights(num_experts: int, skew: float) -> np.ndarray:
    """Popularity by rank (descending), sums to 1; skew 0 = uniform."""
    w = np.arange(1, num_experts + 1, dtype=np.float64) ** -float(skew)
    return w / w.sum()


def _gumbel(rng: np.random.Generator, shape) -> np.ndarray:
    u = rng.random(shape, dtype=np.float32)
    np.clip(u, 1e-12, 1.0 - 1e-7, out=u)
    return -np.log(-np.log(u))


def _topk_desc(keys: np.ndarray, k: int) -> np.ndarray:
    """Column indices of the k largest keys per row, largest first."""
    part = np.argpartition(-keys, k - 1, axis=1)[:, :k]
    order = np.argsort(-np.take_along_axis(keys, part, axis=1), axis=1)
    return np.take_along_axis(part, order, axis=1)


class _Layer:
    """State of one layer's router model."""

    def __init__(self, rng: np.random.Generator, num_experts: int, skew: float,
                 clusters: int | None):
        self.E = num_experts
        self.zipf = zipf_weights(num_experts, skew)
        self.score = rng.standard_normal(num_experts)
        self.members = None
        if clusters is not None:
            if not 1 <= clusters <= num_experts:
                raise ValueError(f"clusters={clusters}: need 1 <= clusters <= num_experts={num_experts}")
            perm = rng.permutation(num_experts)
            size = -(-num_experts // clusters)
            members = np.full(clusters * size, -1, dtype=np.int64)
            members[:num_experts] = perm
            # deal experts round-robin so clusters differ in size by at most one
            self.members = members.reshape(size, clusters).T.copy()  # [C, size], -1 = empty

    def popularity(self) -> np.ndarray:
        p = np.empty(self.E)
        p[np.argsort(-self.score, kind="stable")] = self.zipf
        return p

    def drift(self, rng: np.random.Generator, drift: float) -> None:
        if drift:
            self.score += drift * rng.standard_normal(self.E)

    def sample(self, rng: np.random.Generator, T: int, K: int, strength: float) -> np.ndarray:
        p = self.popularity()
        logp = np.log(p).astype(np.float32)
        gkeys = logp[None, :] + _gumbel(rng, (T, self.E))
        if self.members is None:
            return _topk_desc(gkeys, K)
        members = self.members
        C, size = members.shape
        valid = members >= 0
        pm = np.where(valid, p[np.maximum(members, 0)], 0.0)
        cpop = pm.sum(1)
        cluster = rng.choice(C, size=T, p=cpop / cpop.sum())
        n_in = np.minimum(rng.binomial(K, strength, size=T), valid[cluster].sum(1))
        mem = members[cluster]  # [T, size]
        ckeys = np.where(valid[cluster], logp[np.maximum(mem, 0)] + _gumbel(rng, (T, size)), -np.inf)
        kin = min(K, size)
        corder = _topk_desc(ckeys, kin)
        chosen_in = np.take_along_axis(mem, corder, axis=1)  # [T, kin], by key
        j = np.arange(kin)[None, :]
        take_in = j < n_in[:, None]
        rows = np.nonzero(take_in)[0]
        gkeys[rows, chosen_in[take_in]] = -np.inf  # not again from the global draw
        chosen_out = _topk_desc(gkeys, K)
        take_out = np.arange(K)[None, :] < (K - n_in)[:, None]
        cand = np.concatenate([chosen_in, chosen_out], axis=1)
        mask = np.concatenate([take_in, take_out], axis=1)
        return cand[mask].reshape(T, K)


class SyntheticTrace:
    """Iterable over the steps of a synthetic trace; every iteration replays the same steps.

    cluster_members(layer): the co-activation clusters of a layer (list of expert-id arrays;
    empty without structure). popularity(step): [L, E] expert popularity the router samples from.
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int, tokens_per_step: int, steps: int,
                 skew: float, drift: float, clusters: int | None, cluster_strength: float, seed: int):
        if top_k > num_experts:
            raise ValueError(f"top_k={top_k} > num_experts={num_experts}")
        if not 0.0 <= cluster_strength <= 1.0:
            raise ValueError(f"cluster_strength={cluster_strength} not in [0, 1]")
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.tokens_per_step, self.steps = tokens_per_step, steps
        self.skew, self.drift, self.clusters = skew, drift, clusters
        self.cluster_strength, self.seed = cluster_strength, seed
        _Layer(np.random.default_rng(0), num_experts, skew, clusters)  # argument check

    def _layers(self) -> tuple[np.random.Generator, np.random.Generator, list[_Layer]]:
        """(sampling rng, drift rng, fresh layer states): drift has its own stream."""
        sample_ss, drift_ss = np.random.SeedSequence(self.seed).spawn(2)
        rng = np.random.default_rng(sample_ss)
        layers = [_Layer(rng, self.num_experts, self.skew, self.clusters) for _ in range(self.num_layers)]
        return rng, np.random.default_rng(drift_ss), layers

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[np.ndarray]:
        rng, drift_rng, layers = self._layers()
        for step in range(self.steps):
            if step:
                for layer in layers:
                    layer.drift(drift_rng, self.drift)
            yield np.stack([layer.sample(rng, self.tokens_per_step, self.top_k, self.cluster_strength)
                            for layer in layers]).astype(np.int64)

    def cluster_members(self, layer: int) -> list[np.ndarray]:
        members = self._layers()[2][layer].members
        return [] if members is None else [row[row >= 0] for row in members]

    def popularity(self, step: int) -> np.ndarray:
        """[L, E] popularity the router samples step `step` from (before cluster structure)."""
        _, drift_rng, layers = self._layers()
        for _ in range(step):
            for layer in layers:
                layer.drift(drift_rng, self.drift)
        return np.stack([layer.popularity() for layer in layers])


def synthetic_trace(num_layers: int, num_experts: int = 256, top_k: int = 8,
                    tokens_per_step: int = 4096, steps: int = 32, skew: float = 0.4,
                    drift: float = 0.05, clusters: int | None = 16,
                    cluster_strength: float = 0.75, seed: int = 0) -> SyntheticTrace:
    """Steps topk_ids [num_layers, tokens_per_step, top_k] (int64, distinct per token), as an iterable.

    skew: Zipf exponent of per-layer expert popularity (0 = uniform).
    drift: std of the per-step random walk of the latent popularity scores (0 = static).
    clusters: number of co-activation clusters the experts are split into (None = no structure).
    cluster_strength: probability that each of a token's K experts comes from its cluster.
    Deterministic for a given seed and arguments; iterating again replays the same steps.
    """
    return SyntheticTrace(num_layers, num_experts, top_k, tokens_per_step, steps, skew, drift, clusters,
                          cluster_strength, seed)


# --- SGLang expert-distribution dumps -------------------------------------------------------------------------------

@dataclasses.dataclass
class SglangDump:
    """Per-token routing read from SGLang's `per_token` expert-distribution dumps.

    steps[i]: topk_ids [L, T_i, K] (logical ids, -1 = padding) of forward pass forward_pass_ids[i],
    tokens of all ranks concatenated in rank order; token_ranks[i] [T_i]: the rank that recorded
    each token. layers: the model-layer index of each of the L kept layers (layers that never
    routed a token, i.e. DeepSeek's dense layers, are dropped). num_experts: logical experts.
    """
    steps: list[np.ndarray]
    token_ranks: list[np.ndarray]
    forward_pass_ids: list[int]
    layers: np.ndarray
    num_experts: int

    def __iter__(self):
        return iter(self.steps)

    def __len__(self) -> int:
        return len(self.steps)


def _dump_files(path: Path) -> list[Path]:
    path = Path(path)
    if path.is_dir():
        files = sorted(path.glob("expert_distribution_recorder_*.pt")) or sorted(path.glob("*.pt"))
        if not files:
            raise FileNotFoundError(f"{path}: no expert_distribution_recorder_*.pt files")
        return files
    if not path.exists():
        raise FileNotFoundError(path)
    return [path]


def _load(file: Path):
    import torch

    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle of something beyond tensors/containers
        raise ValueError(f"{file}: cannot be read as an SGLang expert-distribution dump ({e})") from e


def read_sglang_dump(path: str | Path) -> SglangDump:
    """Read SGLang's expert-distribution dump(s) into per-step logical topk_ids [L, T, K].

    `path`: one `expert_distribution_recorder_<time>_<rank>.pt` file or a directory of them (one per
    rank, as `--expert-distribution-recorder-mode per_token` writes into
    SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR on /dump_expert_distribution_record). Each such file is
    torch.save(dict(records=[dict(forward_pass_id, rank, topk_ids_of_layer [L, T, 8] int32, input_ids,
    positions, extend_seq_lens, forward_mode, global_physical_count, ...)], last_physical_to_logical_map
    [L, S])). The recorded ids are *physical* slot ids (after EPLB's logical->physical remap); they are
    mapped back through last_physical_to_logical_map (the map at dump time: exact unless a rebalance
    happened while recording). Records of the same forward pass from several ranks are concatenated.

    The other recorder modes keep no per-token top-k and are refused with a ValueError:
    `stat` / `stat_approx` dump aggregated logical_count [buffer, L, E] only; `per_pass` records
    carry per-pass global_physical_count [L, S] only. Co-activation cannot be recovered from counts.
    """
    by_pass: dict[int, list[tuple[int, np.ndarray]]] = {}
    p2l_ref = None
    for file in _dump_files(path):
        data = _load(file)
        if not isinstance(data, dict):
            raise ValueError(f"{file}: not an SGLang expert-distribution dump (a {type(data).__name__})")
        if "logical_count" in data:
            raise ValueError(
                f"{file}: aggregated counts only (recorder mode 'stat' / 'stat_approx': logical_count "
                f"[steps, layers, experts]); per-token top-k ids are not in this dump, so co-activation "
                f"cannot be simulated. Record with --expert-distribution-recorder-mode per_token.")
        if "records" not in data or "last_physical_to_logical_map" not in data:
            raise ValueError(f"{file}: not an SGLang expert-distribution dump (keys {sorted(data)})")
        p2l = np.asarray(data["last_physical_to_logical_map"]).astype(np.int64)
        if p2l_ref is None:
            p2l_ref = p2l
        elif p2l.shape != p2l_ref.shape:
            raise ValueError(f"{file}: physical_to_logical_map shape {p2l.shape} != {p2l_ref.shape}")
        for rec in data["records"]:
            if "topk_ids_of_layer" not in rec:
                raise ValueError(
                    f"{file}: aggregated counts only (recorder mode 'per_pass': each record holds "
                    f"global_physical_count [layers, physical experts]); per-token top-k ids are not in "
                    f"this dump. Record with --expert-distribution-recorder-mode per_token.")
            phys = np.asarray(rec["topk_ids_of_layer"]).astype(np.int64)  # [L, T, K]
            L = phys.shape[0]
            if L != p2l.shape[0]:
                raise ValueError(f"{file}: {L} layers in topk_ids_of_layer, {p2l.shape[0]} in the map")
            valid = phys >= 0
            logical = np.full_like(phys, -1)
            li = np.broadcast_to(np.arange(L)[:, None, None], phys.shape)
            logical[valid] = p2l[li[valid], phys[valid]]
            by_pass.setdefault(int(rec["forward_pass_id"]), []).append((int(rec.get("rank", 0)), logical))
    if not by_pass:
        raise ValueError(f"{path}: the dump holds no records")
    fids = sorted(by_pass)
    steps, ranks = [], []
    for fid in fids:
        parts = sorted(by_pass[fid], key=lambda x: x[0])
        steps.append(np.concatenate([a for _, a in parts], axis=1))
        ranks.append(np.concatenate([np.full(a.shape[1], r, dtype=np.int64) for r, a in parts]))
    used = np.zeros(steps[0].shape[0], dtype=bool)
    for s in steps:
        used |= (s >= 0).any(axis=(1, 2))
    if not used.any():
        raise ValueError(f"{path}: no layer routed any token")
    layers = np.nonzero(used)[0]
    steps = [s[layers] for s in steps]
    num_experts = int(p2l_ref.max()) + 1
    return SglangDump(steps, ranks, fids, layers, num_experts)
