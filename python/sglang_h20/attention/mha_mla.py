"""Prefill MHA/MLA switching on se = sum(extend_i * (extend_i + prefix_i)), from a per-GPU cost table.

Why: MHA prefill costs about se*(192+128) MACs per head plus expanding the cached prefix's latent KV
(prefix*512*(128+128) per head); absorbed MLA costs about se*(576+512) per head and expands nothing.
So MHA wins unless the prefix is long relative to the new tokens -- a question of se against the
total prefix, weighted by the GPU's own rates. Upstream SGLang 0.5.17 instead compares the total
prefix with one fixed threshold (SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD, default 8192).

The hook wraps SGLang's shared DeepSeek dispatch (`_handle_attention_backend`, used by the fa3,
flashinfer, flashmla, cutlass_mla, fa4 and intel_xpu handlers) and only re-decides where upstream
itself was free to choose: captured prefill, context-parallel prefill, ragged-disabled backends,
speculative modes and a disabled chunked prefix cache all keep upstream's answer. Backends with
their own rule (triton, trtllm_mla, aiter, dsa, ...) are not touched.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

from sglang_h20.features import Hook
from sglang_h20.settings import Settings

HANDLER_MODULE = "sglang.srt.models.deepseek_common.attention_backend_handler"
TARGET = HANDLER_MODULE + "._handle_attention_backend"
TABLE_DIR = Path(__file__).resolve().parent.parent / "tables"
TERMS = ("se", "prefix", "extend", "const")  # cost = sum(coef[t] * feature[t])
UPSTREAM_THRESHOLD = 8192


@dataclasses.dataclass(frozen=True)
class BatchShape:
    """The per-request extend and prefix lengths SGLang already keeps on the CPU."""

    extend: Sequence[int]
    prefix: Sequence[int]

    def __post_init__(self):
        if len(self.extend) != len(self.prefix):
            raise ValueError(f"{len(self.extend)} extend lengths but {len(self.prefix)} prefix lengths")

    @property
    def se(self) -> int:
        return sum(e * (e + p) for e, p in zip(self.extend, self.prefix))

    def features(self) -> dict[str, float]:
        return {"se": self.se, "prefix": sum(self.prefix), "extend": sum(self.extend), "const": 1.0}


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Linear time models (microseconds) of one attention layer's prefill, per method, for one GPU."""

    gpu: str
    source: str  # "measured on <GPU> ..." or "modelled from ..."
    mha: dict[str, float]
    mla: dict[str, float]
    meta: dict = dataclasses.field(default_factory=dict)

    def cost(self, method: str, shape: BatchShape) -> float:
        coef = self.mha if method == "mha" else self.mla
        f = shape.features()
        return sum(coef.get(t, 0.0) * f[t] for t in TERMS)

    def choose(self, shape: BatchShape) -> str:
        if not shape.extend:
            return "mla"  # nothing to compute; keep the cheap-to-plan path
        return "mha" if self.cost("mha", shape) <= self.cost("mla", shape) else "mla"

    def to_json(self) -> dict:
        return {"gpu": self.gpu, "source": self.source, "unit": "us per attention layer (const: per prefill)",
                "terms": list(TERMS), "mha": self.mha, "mla": self.mla, **self.meta}

    @classmethod
    def from_json(cls, d: dict) -> "CostTable":
        for m in ("mha", "mla"):
            unknown = set(d[m]) - set(TERMS)
            if unknown:
                raise ValueError(f"cost table for {d.get('gpu')}: unknown {m} terms {sorted(unknown)}")
        meta = {k: v for k, v in d.items() if k not in ("gpu", "source", "mha", "mla", "unit", "terms")}
        return cls(d["gpu"], d["source"], dict(d["mha"]), dict(d["mla"]), meta)


@dataclasses.dataclass(frozen=True)
class UpstreamRule:
    """SGLang 0.5.17's rule where it is free to choose: MHA if no prefix or total prefix >= threshold."""

    threshold: int = UPSTREAM_THRESHOLD

    def choose(self, shape: BatchShape) -> str:
        total = sum(shape.prefix)
        return "mha" if total == 0 or total >= self.threshold else "mla"


@dataclasses.dataclass(frozen=True)
class Forced:
    """Always one method (where SGLang is free to choose): for calibration and A/B runs."""

    method: str

    def choose(self, shape: BatchShape) -> str:
        return self.method


def table_path(gpu_name: str) -> Path:
    """tables/mha_mla_<gpu>.json, e.g. 'NVIDIA H200' -> mha_mla_h200.json, 'NVIDIA H20' -> mha_mla_h20.json."""
    key = gpu_name.lower().replace("nvidia", "").strip().split()[0] if gpu_name.strip() else "unknown"
    return TABLE_DIR / f"mha_mla_{key}.json"


def load_table(gpu_name: str, path: Path | None = None) -> CostTable:
    path = path or table_path(gpu_name)
    if not path.exists():
        known = sorted(p.stem.removeprefix("mha_mla_") for p in TABLE_DIR.glob("mha_mla_*.json"))
        raise FileNotFoundError(f"no MHA/MLA cost table for {gpu_name!r} ({path.name}; shipped: {known}); "
                                f"make one with: python -m sglang_h20 calibrate mha-mla")
    return CostTable.from_json(json.loads(path.read_text()))


def policy_for(settings: Settings, gpu_name: str):
    mode = settings["mha_mla_policy"]
    if mode == "se":
        return load_table(gpu_name)
    if mode in ("mha", "mla"):
        return Forced(mode)
    return UpstreamRule()


def free_to_choose(h, attn, forward_batch, backend_name: str) -> bool:
    """Upstream's own preconditions for MHA, read through its module `h` (so its globals count)."""
    if h.is_in_tc_piecewise_cuda_graph() or h.is_in_breakable_cuda_graph():
        return False  # captured prefill pins MLA
    if h.mla_use_prefill_cp(forward_batch):
        return False
    if backend_name in ("flashinfer", "flashmla") and attn.flashinfer_mla_disable_ragged:
        return False
    if not forward_batch.forward_mode.is_extend_without_speculative():
        return False
    has_prefix = h._get_sum_extend_prefix_lens(forward_batch) > 0
    return not (has_prefix and attn.disable_chunked_prefix_cache)


def make_router(policy):
    """The AROUND hook: upstream's answer unless it was free to choose; then the policy's."""
    import importlib

    h = importlib.import_module(HANDLER_MODULE)

    def route(original, attn, forward_batch, backend_name):
        if not free_to_choose(h, attn, forward_batch, backend_name):
            return original(attn, forward_batch, backend_name)
        prefix = forward_batch.extend_prefix_lens_cpu or [0] * len(forward_batch.extend_seq_lens_cpu or [])
        shape = BatchShape(list(forward_batch.extend_seq_lens_cpu or []), list(prefix))
        if policy.choose(shape) == "mha":
            if h._support_mha_one_shot(attn, forward_batch, backend_name):
                return h.AttnForwardMethod.MHA_ONE_SHOT
            return h.AttnForwardMethod.MHA_CHUNKED_KV
        return h._dispatch_mla_subtype(attn, forward_batch)

    route.policy = policy
    return route


def hooks(settings: Settings) -> list[Hook]:
    from sglang_h20 import compat

    g = compat.gpu()
    return [Hook(TARGET, make_router(policy_for(settings, g.name if g else "")), "around")]
