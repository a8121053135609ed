"""Per-layer expert load and top-k co-activation counts: what placement optimizes.

coact[l, i, j] counts the tokens of layer l whose top-k contained both expert i and expert j
(i != j); the diagonal holds the load (tokens routed to i). Symmetric by construction.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

FORMAT = "sglang_h20.coact.v1"


@dataclasses.dataclass
class CoactivationStats:
    coact: np.ndarray  # [L, E, E] int64, symmetric; diagonal = load
    tokens: int = 0  # tokens counted (per layer)

    @property
    def num_layers(self) -> int:
        return self.coact.shape[0]

    @property
    def num_experts(self) -> int:
        return self.coact.shape[1]

    @property
    def load(self) -> np.ndarray:
        """[L, E] tokens routed to each expert."""
        return np.einsum("lii->li", self.coact)

    @classmethod
    def empty(cls, num_layers: int, num_experts: int) -> "CoactivationStats":
        return cls(np.zeros((num_layers, num_experts, num_experts), dtype=np.int64))

    @classmethod
    def from_topk_ids(cls, topk_ids: np.ndarray, num_experts: int) -> "CoactivationStats":
        """topk_ids [L, T, K] (ids < 0 are padding and ignored)."""
        s = cls.empty(topk_ids.shape[0], num_experts)
        s.add_topk_ids(topk_ids)
        return s

    def add_topk_ids(self, topk_ids: np.ndarray) -> None:
        L, T, K = topk_ids.shape
        E = self.num_experts
        onehot = np.zeros((L, T, E), dtype=np.int64)
        lt = np.indices((L, T, K))
        valid = topk_ids >= 0
        np.add.at(onehot, (lt[0][valid], lt[1][valid], topk_ids[valid]), 1)
        onehot = np.minimum(onehot, 1)  # a token counts an expert once
        self.coact += np.einsum("lti,ltj->lij", onehot, onehot)
        self.tokens += T

    def save(self, path: Path) -> Path:
        np.savez_compressed(path, format=FORMAT, coact=self.coact, tokens=self.tokens)
        return Path(path)

    @classmethod
    def load_file(cls, path: Path) -> "CoactivationStats":
        with np.load(path, allow_pickle=False) as z:
            if str(z["format"]) != FORMAT:
                raise ValueError(f"{path}: not a {FORMAT} file (format {z['format']})")
            return cls(z["coact"].astype(np.int64), int(z["tokens"]))
