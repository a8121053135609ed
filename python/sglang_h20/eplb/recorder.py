"""Device-side recorder of per-layer top-k co-activation counts (what `CoactivationStats` holds).

Everything stays on the device and uses fixed-shape torch ops, with no host sync (no `.item()`,
no data-dependent shapes) per `record` call, so a `record` issued while a CUDA graph is being
captured becomes part of that graph and runs on every replay.

Layout: one int64 accumulator `acc` of shape [L, E+1, E+1]. Rows and columns 0..E-1 are
the experts; index E is "this token counted". Each call builds a 0/1 matrix `a` [T, E+1]
(a[t, e] = token t picked expert e; a[t, E] = token t picked at least one valid expert) and adds
`a.T @ a`. So acc[l, :E, :E] is the co-activation matrix (diagonal = load), and acc[l, E, E] is
the number of tokens counted in layer l. The extra row and column cost one more row and column
of the same GEMM instead of separate reduction kernels.

Cost of one `record(layer, topk_ids[T, K])`:
- FLOPs: one [E+1, T] x [T, E+1] GEMM = 2*T*(E+1)^2, i.e. about 132 kFLOP per token for E=256.
  For DeepSeek-V3 (58 MoE layers) that is about 7.7 MFLOP per token, about 1e-4 of the model's own
  ~74 GFLOP per token. The other formulation, a [T, E] x [E, T] token-token product, is
  O(T^2 * E) and grows with the batch, so we use the expert-expert one.
- Memory: a [T, E+2] float32 one-hot (T=8192: 8.4 MB, freed at once), the [E+1, E+1] product,
  and the [L, E+1, E+1] int64 accumulator (L=61, E=256: 32 MB per GPU).
- Launches: about 10 small kernels per call (index remap, zeros, scatter, amax, GEMM, cast, add).
  Decode is launch-bound, not FLOP-bound, and in a CUDA graph these kernels run on every replay.

Exactness: the GEMM runs in float32 (TF32 is fine too: its inputs are exactly 0 or 1) and each
entry of one call's product is an integer <= T, which float32 holds exactly up to 2^24. Calls with
more rows are split into chunks of that size. The sum runs in int64.

Sampling: `step()` advances a step counter; step s is recorded when `s % sample_every == 0`
(step 0 included) and the recorder is active (`set_active`). In eager mode an unsampled call
returns before launching anything. Inside a captured graph the host cannot decide per replay, so
the one-hot values are multiplied by a device scalar gate (1 = sampled and active, 0 = not) that
`step()`/`set_active()` rewrite with one `fill_` whenever it changes. A replayed graph therefore
pays the full cost even on unsampled steps. Sampling saves time in eager mode only.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from sglang_h20.eplb.stats import CoactivationStats

MAX_ROWS_PER_GEMM = 1 << 24  # float32 holds every integer up to 2^24 exactly


def _capturing(device: torch.device) -> bool:
    """True while the current CUDA stream is capturing a graph (never on CPU tensors)."""
    if device.type != "cuda":
        return False
    try:
        return torch.cuda.is_current_stream_capturing()
    except Exception:
        return False


class CoactivationRecorder:
    """Accumulate pairwise top-k co-activation counts per layer on `device`."""

    def __init__(self, num_layers: int, num_experts: int, device, sample_every: int = 1):
        if num_layers <= 0 or num_experts <= 0:
            raise ValueError(f"need num_layers, num_experts > 0, got {num_layers}, {num_experts}")
        if int(sample_every) < 1:
            raise ValueError(f"sample_every must be >= 1, got {sample_every}")
        self.num_layers = int(num_layers)
        self.num_experts = int(num_experts)
        self.device = torch.device(device)
        self.sample_every = int(sample_every)
        E = self.num_experts
        # Normal tensors even when built inside SGLang's inference_mode forward: inference tensors
        # reject the in-place updates (step, reset) that happen outside it.
        with torch.inference_mode(False):
            self.acc = torch.zeros((self.num_layers, E + 1, E + 1), dtype=torch.int64, device=self.device)
            self._gate = torch.ones((), dtype=torch.float32, device=self.device)
        self._gate_value = 1.0  # host copy of _gate, so an unchanged gate costs no kernel
        self._step = 0
        self._active = True

    # ----------------------------------------------------------------- sampling state
    @property
    def step_count(self) -> int:
        return self._step

    @property
    def active(self) -> bool:
        return self._active

    @property
    def sampling(self) -> bool:
        """Whether the current step is recorded."""
        return self._active and self._step % self.sample_every == 0

    def step(self) -> None:
        """Advance to the next step (call once per forward pass, outside graph capture)."""
        self._step += 1
        self._sync_gate()

    def set_active(self, active: bool) -> None:
        """Turn recording on or off without touching counts (e.g. to follow SGLang's recorder)."""
        self._active = bool(active)
        self._sync_gate()

    def _sync_gate(self) -> None:
        value = 1.0 if self.sampling else 0.0
        if value != self._gate_value:
            self._gate.fill_(value)  # one tiny kernel on the current stream, no host sync
            self._gate_value = value

    # ----------------------------------------------------------------- recording
    def record(self, layer_id: int, topk_ids: torch.Tensor, num_valid_tokens=None) -> None:
        """Add the co-activation counts of one layer's routing: topk_ids [T, K].

        Ids outside [0, num_experts) are ignored: -1 is padding, and ids >= E are fused
        shared-expert slots. An id repeated within one token counts once. Rows with index
        >= num_valid_tokens (an int, or a device scalar tensor such as SGLang's
        `num_token_non_padded`) are ignored entirely.
        """
        if topk_ids.dim() != 2:
            raise ValueError(f"topk_ids must be [T, K], got shape {tuple(topk_ids.shape)}")
        if not 0 <= layer_id < self.num_layers:
            raise IndexError(f"layer_id {layer_id} outside [0, {self.num_layers})")
        if not self.sampling and not _capturing(topk_ids.device):
            return  # eager and unsampled: nothing to launch
        T = topk_ids.shape[0]
        for start in range(0, T, MAX_ROWS_PER_GEMM):
            stop = min(T, start + MAX_ROWS_PER_GEMM)
            self._accumulate(layer_id, topk_ids[start:stop], num_valid_tokens, start)

    def _accumulate(self, layer_id: int, topk_ids: torch.Tensor, num_valid_tokens, row0: int) -> None:
        E = self.num_experts
        T = topk_ids.shape[0]
        if T == 0:
            return
        ids = topk_ids.to(device=self.device, dtype=torch.int64)
        # Column E+1 is a dump for ignored ids, dropped before the GEMM.
        keep = (ids >= 0) & (ids < E)
        if num_valid_tokens is not None:
            rows = torch.arange(row0, row0 + T, device=self.device)
            if isinstance(num_valid_tokens, torch.Tensor):
                limit = num_valid_tokens.to(device=self.device).reshape(())
            else:
                limit = int(num_valid_tokens)
            keep &= (rows < limit).unsqueeze(1)
        ids = torch.where(keep, ids, E + 1)
        onehot = torch.zeros((T, E + 2), dtype=torch.float32, device=self.device)
        # scatter_ (not scatter_add_): a duplicate id writes the same value twice, so counts once.
        onehot.scatter_(1, ids, self._gate.expand(ids.shape))
        onehot[:, E] = onehot[:, :E].amax(dim=1)  # token counted iff it kept >= 1 expert
        a = onehot[:, : E + 1]
        counts = a.t() @ a  # [E+1, E+1], exact integers <= T (gate is 0 or 1)
        self.acc[layer_id] += counts.to(torch.int64)

    # ----------------------------------------------------------------- read-out
    def reset(self) -> None:
        """Zero all counts (keeps the step counter and the active flag)."""
        self.acc.zero_()

    def _host_stats(self, acc: torch.Tensor) -> CoactivationStats:
        E = self.num_experts
        host = acc.to("cpu").numpy()
        coact = np.ascontiguousarray(host[:, :E, :E], dtype=np.int64)
        tokens = int(host[:, E, E].max()) if host.shape[0] else 0
        return CoactivationStats(coact, tokens)

    def snapshot(self, all_reduce: bool = False, group=None) -> CoactivationStats:
        """Copy the counts to the host (one device->host copy, which syncs).

        all_reduce: first sum the counts over the ranks of `group` (default: the world) when
        torch.distributed is initialized with more than one rank. This is a collective, so every
        rank of the group must call it at the same point. `tokens` is the largest per-layer token
        count (every MoE layer of one step sees the same tokens).
        """
        acc = self.acc
        if all_reduce and torch.distributed.is_available() and torch.distributed.is_initialized():
            if torch.distributed.get_world_size(group) > 1:
                acc = acc.clone()
                torch.distributed.all_reduce(acc, op=torch.distributed.ReduceOp.SUM, group=group)
        return self._host_stats(acc)

    def dump(self, path) -> Path:
        """Write the current counts with CoactivationStats.save (numpy .npz)."""
        return self.snapshot().save(path)
