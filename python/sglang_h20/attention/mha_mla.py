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
their own rule (triton, trtllm_mla, aiter, dsa, ...) are not touched; when the model runner's prefill backend is
one of those, one line per process says that the policy is inert there (`note_prefill_backend`).

A table may also carry the measured grid it was fitted to (`measured_grid`, written by
benchmark/attention/mha_mla_layer.py): kernel efficiency changes with shape in ways four linear terms
cannot follow, so near the crossover a linear model alone can pick the slower path by more than a few
percent. The grid corrects each method's linear cost by its measured log-residual, interpolated
between grid nodes (see MeasuredGrid); at a measured shape the choice is the measured faster one.

A layer-level table misses what a whole prefill pays once for taking MHA on a batch with a cached prefix
(`mha_prefix_overhead_us`, measured in the server: `prefix_ttft.py --one-server --arms mla mha --fit-overhead`).
On the H200 it was ~4 ms per prefill on the 4-layer model, and of the same order on a 1-layer model, so it is
charged once per forward, against the per-layer gain times this rank's attention layers (the KV pool's
layer_num): on 61 layers it rarely matters, on 4 layers it decides the small prefills.
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import json
import logging
import math
import os
import statistics
from pathlib import Path
from typing import Sequence

from sglang_h20.features import Hook
from sglang_h20.logonce import OnceLog
from sglang_h20.settings import Settings

HANDLER_MODULE = "sglang.srt.models.deepseek_common.attention_backend_handler"
TARGET = HANDLER_MODULE + "._handle_attention_backend"
BACKENDS_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends"
# prefill backends whose DeepSeek handler goes through TARGET (SGLang 0.5.17's registry, and ours)
SHARED_DISPATCH = ("fa3", "flashinfer", "flashmla", "cutlass_mla", "fa4", "intel_xpu", "h20_fp8_mla")
TABLE_DIR = Path(__file__).resolve().parent.parent / "tables"
log = logging.getLogger("sglang_h20.mha_mla")
_note = OnceLog(log, "mha_mla policy: ")
TERMS = ("se", "prefix", "extend", "const")  # cost = sum(coef[t] * feature[t])
UPSTREAM_THRESHOLD = 8192
# flashinfer's absorbed-MLA prefill (the flashmla and flashinfer backends) was right up to 16436 new tokens in one
# batch, at up to 278k cached + new tokens, and wrong from 24911 on (H200, 2026-11-29: rel 1.0 / inf against
# float32, test_chunked_mha_at_full_capacity). SGLang's chunked prefill keeps a batch at <= 16k new tokens; above
# this bound the policy keeps MHA, which was right at every size.
MLA_MAX_EXTEND_TOKENS = 16436


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


GRID_AXES = ("batch", "extend", "prefix")
MEMO_SIZE = 256  # the router asks once per layer with the same batch: remember recent answers


def _uniform(batch: int, extend: float, prefix: float) -> dict[str, float]:
    """Features of `batch` requests of `extend` new tokens on `prefix` cached tokens each."""
    return {"se": batch * extend * (extend + prefix), "prefix": batch * prefix, "extend": batch * extend, "const": 1.0}


def _linear(coef: dict[str, float], f: dict[str, float]) -> float:
    return sum(coef.get(t, 0.0) * f[t] for t in TERMS)


def _coords(axis: str, values: Sequence[float]) -> list[float]:
    """Interpolation coordinates: log2 of batch and extend, log2(1 + prefix) (prefix 0 is a grid line)."""
    return [math.log2(1 + v) if axis == "prefix" else math.log2(v) for v in values]


def _bracket(coords: list[float], x: float) -> tuple[int, int, float]:
    """Neighbouring nodes and the weight of the upper one; clamped to the edge outside the grid."""
    if x <= coords[0]:
        return 0, 0, 0.0
    if x >= coords[-1]:
        n = len(coords) - 1
        return n, n, 0.0
    i = bisect.bisect_right(coords, x) - 1
    return i, i + 1, (x - coords[i]) / (coords[i + 1] - coords[i])


def grid_from_points(points: Sequence[dict]) -> dict:
    """The JSON grid of measured points ({batch, extend, prefix, mha_us, mla_us}); null where not measured."""
    axes = {a: sorted({int(p[a]) for p in points}) for a in GRID_AXES}
    at = {(int(p["batch"]), int(p["extend"]), int(p["prefix"])): p for p in points}
    grid: dict = dict(axes)
    for m in ("mha", "mla"):
        grid[f"{m}_us"] = [[[at[(b, e, q)].get(f"{m}_us") if (b, e, q) in at else None for q in axes["prefix"]]
                            for e in axes["extend"]] for b in axes["batch"]]
    return grid


@dataclasses.dataclass(frozen=True)
class MeasuredGrid:
    """Per-method log(measured / linear) on a (batch, extend, prefix) grid of uniform batches.

    Why: the correction keeps the linear model's shape dependence (se, prefix) between and beyond the
    measured points while matching the measurement at each of them. Between nodes the residual is
    trilinear in (log2 batch, log2 extend, log2(1 + prefix)); outside it is the edge's. A node that was
    not measured (over the benchmark's token budget) takes the mean residual of its measured axis
    neighbours, or else that of the nearest measured node.
    A mixed batch is looked up at the uniform batch with the same size, se and total prefix.
    """

    axes: dict[str, list[float]]  # interpolation coordinates per axis
    residual: dict[str, list]  # method -> [batch][extend][prefix] log residual

    @classmethod
    def build(cls, grid: dict, mha: dict[str, float], mla: dict[str, float]) -> "MeasuredGrid":
        axes = {a: [float(v) for v in grid[a]] for a in GRID_AXES}
        for a, vals in axes.items():
            if not vals or any(v < (0 if a == "prefix" else 1) for v in vals) or vals != sorted(set(vals)):
                raise ValueError(f"cost table grid: axis {a} must be ascending, distinct, in range: {grid[a]}")
        shape = tuple(len(axes[a]) for a in GRID_AXES)
        residual = {}
        for m, coef in (("mha", mha), ("mla", mla)):
            t = grid.get(f"{m}_us")
            if (t is None or len(t) != shape[0] or any(len(r) != shape[1] for r in t)
                    or any(len(c) != shape[2] for r in t for c in r)):
                raise ValueError(f"cost table grid: {m}_us must be nested lists of shape {shape}")
            res: dict[tuple[int, int, int], float] = {}
            for i, b in enumerate(axes["batch"]):
                for j, e in enumerate(axes["extend"]):
                    for k, p in enumerate(axes["prefix"]):
                        v = t[i][j][k]
                        if v is not None and v > 0:
                            lin = max(_linear(coef, _uniform(b, e, p)), 1e-3)
                            res[(i, j, k)] = math.log(v / lin)
            residual[m] = [[[res[(i, j, k)] if (i, j, k) in res else cls._fill(res, i, j, k)
                             for k in range(shape[2])] for j in range(shape[1])] for i in range(shape[0])]
        return cls({a: _coords(a, axes[a]) for a in GRID_AXES}, residual)

    @staticmethod
    def _fill(res: dict, i: int, j: int, k: int) -> float:
        """An unmeasured node: the mean of its measured axis neighbours, else the nearest measured node."""
        near = [res[n] for n in ((i, j - 1, k), (i, j + 1, k), (i, j, k - 1), (i, j, k + 1), (i - 1, j, k),
                                 (i + 1, j, k)) if n in res]
        if near:
            return sum(near) / len(near)
        if not res:
            return 0.0
        # the same batch first (a batch step weighs more than any extend/prefix step), then the closest node
        key = min(res, key=lambda n: (100 * abs(n[0] - i) + abs(n[1] - j) + abs(n[2] - k), n))
        return res[key]

    def correction(self, method: str, batch: float, extend: float, prefix: float) -> float:
        """exp(interpolated residual) at a uniform batch: multiply the linear cost by it."""
        r = self.residual[method]
        (i0, i1, ti), (j0, j1, tj), (k0, k1, tk) = (
            _bracket(self.axes[a], c) for a, c in zip(GRID_AXES, _coords_of(batch, extend, prefix)))
        acc = 0.0
        for i, wi in ((i0, 1 - ti), (i1, ti)):
            for j, wj in ((j0, 1 - tj), (j1, tj)):
                for k, wk in ((k0, 1 - tk), (k1, tk)):
                    w = wi * wj * wk
                    if w:
                        acc += w * r[i][j][k]
        return math.exp(acc)


def _coords_of(batch: float, extend: float, prefix: float) -> tuple[float, float, float]:
    return math.log2(batch), math.log2(max(extend, 1e-9)), math.log2(1 + prefix)


def equivalent_uniform(shape: BatchShape) -> tuple[int, float, float]:
    """(batch, extend, prefix) of the uniform batch with the same size, se and total prefix as `shape`."""
    b, total_prefix, se = len(shape.extend), sum(shape.prefix), shape.se
    if se <= 0:
        return b, 0.0, total_prefix / b
    # b*e^2 + total_prefix*e = se
    e = 2 * se / (total_prefix + math.sqrt(total_prefix * total_prefix + 4 * b * se))
    return b, e, total_prefix / b


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Time models (microseconds) of one attention layer's prefill, per method, for one GPU.

    Linear in the batch features; with `measured_grid`, corrected by it (MeasuredGrid).
    """

    gpu: str
    source: str  # "measured on <GPU> ..." or "modelled from ..."
    mha: dict[str, float]
    mla: dict[str, float]
    meta: dict = dataclasses.field(default_factory=dict)
    measured_grid: dict | None = None  # grid_from_points(...) of a measurement, or None: linear only
    mha_prefix_overhead_us: float = 0.0  # once per prefill that takes MHA with a cached prefix (module doc)
    _measured: MeasuredGrid | None = dataclasses.field(default=None, init=False, compare=False, repr=False)
    _memo: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self):
        if self.measured_grid is not None:
            object.__setattr__(self, "_measured", MeasuredGrid.build(self.measured_grid, self.mha, self.mla))

    def linear_cost(self, method: str, shape: BatchShape) -> float:
        return _linear(self.mha if method == "mha" else self.mla, shape.features())

    def cost(self, method: str, shape: BatchShape) -> float:
        lin = self.linear_cost(method, shape)
        if self._measured is None or not shape.extend:
            return lin
        return max(lin, 1e-3) * self._measured.correction(method, *equivalent_uniform(shape))

    def prefill_cost(self, method: str, shape: BatchShape, layers: int | None = None) -> float:
        """One prefill over `layers` attention layers, with MHA's once-per-prefill cost; per layer without it
        when layers is None (the layer-level benchmark's view)."""
        if not layers:
            return self.cost(method, shape)
        fixed = self.mha_prefix_overhead_us if method == "mha" and any(shape.prefix) else 0.0
        return layers * self.cost(method, shape) + fixed

    def choose(self, shape: BatchShape, layers: int | None = None) -> str:
        if not shape.extend:
            return "mla"  # nothing to compute; keep the cheap-to-plan path
        if sum(shape.extend) > MLA_MAX_EXTEND_TOKENS:
            return "mha"
        key = (tuple(shape.extend), tuple(shape.prefix), layers)
        hit = self._memo.get(key)
        if hit is None:
            hit = "mha" if self.prefill_cost("mha", shape, layers) <= self.prefill_cost("mla", shape, layers) \
                else "mla"
            if len(self._memo) >= MEMO_SIZE:
                self._memo.clear()
            self._memo[key] = hit
        return hit

    def to_json(self) -> dict:
        d = {"gpu": self.gpu, "source": self.source, "unit": "us per attention layer (const: per prefill)",
             "terms": list(TERMS), "mha": self.mha, "mla": self.mla, **self.meta}
        if self.mha_prefix_overhead_us:
            d["mha_prefix_overhead_us"] = self.mha_prefix_overhead_us
        if self.measured_grid is not None:
            d["measured_grid"] = self.measured_grid
        return d

    @classmethod
    def from_json(cls, d: dict) -> "CostTable":
        for m in ("mha", "mla"):
            unknown = set(d[m]) - set(TERMS)
            if unknown:
                raise ValueError(f"cost table for {d.get('gpu')}: unknown {m} terms {sorted(unknown)}")
        own = ("gpu", "source", "mha", "mla", "unit", "terms", "measured_grid", "mha_prefix_overhead_us")
        meta = {k: v for k, v in d.items() if k not in own}
        return cls(d["gpu"], d["source"], dict(d["mha"]), dict(d["mla"]), meta, d.get("measured_grid"),
                   float(d.get("mha_prefix_overhead_us", 0.0)))


@dataclasses.dataclass(frozen=True)
class UpstreamRule:
    """SGLang 0.5.17's rule where it is free to choose: MHA if no prefix or total prefix >= threshold."""

    threshold: int = UPSTREAM_THRESHOLD

    def choose(self, shape: BatchShape, layers: int | None = None) -> str:
        total = sum(shape.prefix)
        return "mha" if total == 0 or total >= self.threshold else "mla"


@dataclasses.dataclass(frozen=True)
class Forced:
    """Always one method (where SGLang is free to choose): for calibration and A/B runs."""

    method: str

    def choose(self, shape: BatchShape, layers: int | None = None) -> str:
        return self.method


def _table_name(gpu_name: str) -> str:
    # one file-name key for every per-GPU table; imported here because the kernel package's import brings torch
    # and triton (about 1.4 s), which this module does not otherwise need
    from sgl_kernel_ext.gemm_table import gpu_key

    return f"mha_mla_{gpu_key(gpu_name)}.json"


def table_path(gpu_name: str) -> Path:
    """The shipped table: tables/mha_mla_<gpu>.json ('NVIDIA H200' -> mha_mla_h200.json)."""
    return TABLE_DIR / _table_name(gpu_name)


def user_table_path(gpu_name: str) -> Path:
    """Where `python -m sglang_h20 calibrate mha-mla` writes on this machine, and where the loader looks
    first: $XDG_CACHE_HOME (default ~/.cache) /sglang_h20/mha_mla_<gpu>.json."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "sglang_h20" / _table_name(gpu_name)


def find_table(gpu_name: str) -> Path:
    """The table file in force: this machine's re-tune if there is one, else the shipped one (which may not exist)."""
    user = user_table_path(gpu_name)
    return user if user.exists() else table_path(gpu_name)


def load_table(gpu_name: str, path: Path | None = None) -> CostTable:
    """This machine's re-tune if there is one, else the shipped table (or `path`)."""
    path = path or find_table(gpu_name)
    if not path.exists():
        known = sorted(p.stem.removeprefix("mha_mla_") for p in TABLE_DIR.glob("mha_mla_*.json"))
        raise FileNotFoundError(f"no MHA/MLA cost table for {gpu_name!r} ({path.name}; shipped: {known}); "
                                f"make one with: python -m sglang_h20 calibrate mha-mla")
    st = path.stat()
    return _parse_table(str(path), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=8)
def _parse_table(path: str, mtime_ns: int, size: int) -> CostTable:
    """One parse per version of a table file: the start-up line and the router read the same table."""
    return CostTable.from_json(json.loads(Path(path).read_text()))


def named_policy(mode: str, gpu_name: str):
    """The policy a switch word names: 'se' (this GPU's table), 'mha'/'mla' (forced), else upstream's rule."""
    if mode == "se":
        return load_table(gpu_name)
    if mode in ("mha", "mla"):
        return Forced(mode)
    return UpstreamRule()


class Switchable:
    """The policy named in a control file (SGLANG_H20_MHA_MLA_CONTROL), re-read when it changes: one
    server can alternate 'upstream' and 'se' between measured blocks. A missing file or an unknown
    word keeps the policy in force (one log line per bad version of the file). Each rank reads the
    file itself, so with several ranks a switch may land one batch apart: both paths give the same
    attention up to bf16 rounding."""

    MODES = ("se", "upstream", "mha", "mla")

    def __init__(self, initial: str, path: str, gpu_name: str):
        from sglang_h20.controlfile import ControlFile

        self._file, self._gpu = ControlFile(path), gpu_name
        self._policies: dict[str, object] = {}
        self.mode = initial
        self._current = self._get(initial)

    def _get(self, mode: str):
        if mode not in self._policies:
            self._policies[mode] = named_policy(mode, self._gpu)
        return self._policies[mode]

    def choose(self, shape: BatchShape, layers: int | None = None) -> str:
        got = self._file.changed()
        if got is not None:
            _, word = got
            if word in self.MODES:
                try:  # 'se' needs this GPU's table: a serving process must not die on a control-file word
                    self.mode, self._current = word, self._get(word)
                except Exception as e:
                    log.warning("mha_mla: control file %s says %r, but %s: %s; keeping %r", self._file.path, word,
                                type(e).__name__, e, self.mode)
            else:
                log.warning("mha_mla: control file %s says %r; keeping %r (one of %s)", self._file.path, word,
                            self.mode, "/".join(self.MODES))
        return self._current.choose(shape, layers)


def policy_for(settings: Settings, gpu_name: str):
    mode = settings["mha_mla_policy"]
    if settings["mha_mla_control"]:
        return Switchable(mode, settings["mha_mla_control"], gpu_name)
    return named_policy(mode, gpu_name)


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


def attention_layers() -> int | None:
    """Attention layers this rank runs per forward (its KV pool's layers); None where SGLang does not say."""
    try:
        from sglang.srt.model_executor.forward_context import get_token_to_kv_pool

        n = int(get_token_to_kv_pool().layer_num)
        return n if n > 0 else None
    except Exception:
        return None


def fit_mha_prefix_overhead(table: CostTable, samples: Sequence[tuple[BatchShape, float, float]],
                            layers: int) -> dict:
    """The once-per-prefill cost of MHA with a cached prefix, from server timings of the same prefill
    both ways: samples (shape, mha_ms, mla_ms), e.g. paired medians of single requests. Each gives
    (mha - mla) + layers * (table's per-layer MLA - MHA cost); the median is robust to a noisy one."""
    vals = []
    for shape, mha_ms, mla_ms in samples:
        if not any(shape.prefix):
            raise ValueError(f"{shape}: no cached prefix, so no MHA prefix cost to see")
        vals.append(1e3 * (mha_ms - mla_ms) + layers * (table.cost("mla", shape) - table.cost("mha", shape)))
    if not vals:
        raise ValueError("no samples")
    return {"mha_prefix_overhead_us": max(0.0, statistics.median(vals)), "values_us": sorted(vals), "layers": layers}


def make_router(policy):
    """The AROUND hook: upstream's answer unless it was free to choose; then the policy's."""
    import importlib

    h = importlib.import_module(HANDLER_MODULE)

    def route(original, attn, forward_batch, backend_name):
        if not free_to_choose(h, attn, forward_batch, backend_name):
            return original(attn, forward_batch, backend_name)
        prefix = forward_batch.extend_prefix_lens_cpu or [0] * len(forward_batch.extend_seq_lens_cpu or [])
        shape = BatchShape(list(forward_batch.extend_seq_lens_cpu or []), list(prefix))
        if policy.choose(shape, attention_layers()) == "mha":
            if h._support_mha_one_shot(attn, forward_batch, backend_name):
                return h.AttnForwardMethod.MHA_ONE_SHOT
            return h.AttnForwardMethod.MHA_CHUNKED_KV
        return h._dispatch_mla_subtype(attn, forward_batch)

    route.policy = policy
    return route


def note_prefill_backend(result, runner, *args, **kwargs) -> None:
    """AFTER ModelRunner.init_attention_backends: say once when this runner's prefill backend has SGLang's own
    MHA/MLA rule, which the policy does not touch (the switch is on, yet nothing changes there)."""
    name = getattr(runner, "prefill_attention_backend_str", None)
    if name and name not in SHARED_DISPATCH:
        _note(f"inert with prefill backend {name!r}: it has its own MHA/MLA rule in SGLang, which is kept "
              f"(the policy applies to {', '.join(SHARED_DISPATCH)})")


def enabled(settings: Settings) -> None:
    """Once on: the cost table the 'se' policy reads (the plugin calls this after the feature's line)."""
    if settings["mha_mla_policy"] != "se":
        return
    from sglang_h20 import compat

    g = compat.gpu()
    gpu = g.name if g else ""
    path = find_table(gpu)
    table = load_table(gpu, path)
    other = "" if table.gpu == gpu else f", running on {gpu}"
    log.info("mha_mla_policy: table %s (%s%s), %s; re-tune here: python -m sglang_h20 calibrate mha-mla", path,
             table.source.split(" (")[0], other, table.meta.get("provenance", {}).get("date", "undated"))


def hooks(settings: Settings) -> list[Hook]:
    from sglang_h20 import compat

    g = compat.gpu()
    return [Hook(TARGET, make_router(policy_for(settings, g.name if g else "")), "around"),
            Hook(BACKENDS_TARGET, note_prefill_backend, "after")]
