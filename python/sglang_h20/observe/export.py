"""Where observe records go: rolling JSON-lines dumps, and Prometheus series on SGLang's /metrics.

Record schema (one JSON object per line; `recorder.StageRecorder.poll` and `synth` write it):

kind "stages" (a sampled decode pass: an instrumented graph twin replayed, graph_sampled=true and window_ms,
               or in the fallback an eager pass):
    ts (unix s), rank, step (ModelRunner.forward_pass_id, the same on every rank), mode, eager,
    clock ("cuda" events or "cpu" perf_counter), step_ms, cpu_ms (host time of the pass),
    layers: [{layer, stages: {stage: ms}, overlap: {stage: ms}?}],  stage names: recorder.STAGES
    outside: {"outside_layers": ms, ...}   (step time outside every layer frame)
    coverage: share of step_ms inside layer frames
    graph_would_run: whether SGLang would have replayed a graph (null: unknown)
    batch_size?, num_tokens?,
    expert_load: [[count per physical expert] per MoE layer], expert_load_layers: [layer ids],
    num_experts, experts_per_rank, ep_size, balancedness: [mean/max of the per-rank load per MoE
    layer, from this rank's own routing], remote_share? (ep_size > 1): [share of this rank's routed
    (token, expert) pairs sent to another rank, per MoE layer], token_leave_share? (ep_size > 1): [share of
    this rank's tokens with an expert on another rank], remote_copies_per_token? (ep_size > 1): [other ranks
    a token is sent to, mean] (the two that placement can lower: a token's rank does not follow its experts)
    rank_latency_ms?: [[ms]] rank x rank (src row, dst col), when a latency probe provides one
kind "graph" (a graph-replay reference pass): ts, rank, step, step_ms, mode, eager=false, ...

Prometheus: SGLang runs prometheus_client in multiprocess mode when `--enable-metrics` is given
(`set_prometheus_multiproc_dir()` in the launcher, before the schedulers are spawned; the HTTP
server's /metrics mounts a MultiProcessCollector over PROMETHEUS_MULTIPROC_DIR). Metric objects
created in a scheduler process therefore appear on the existing endpoint with no extra server,
like SGLang's own `sglang:*` series (Gauge with multiprocess_mode="mostrecent"). We export:
    sglang_h20:stage_ms{layer,stage,rank}          gauge, last sampled pass
    sglang_h20:step_stage_ms{stage,rank}           histogram, per pass summed over layers
    sglang_h20:step_ms{rank,kind}                  gauge, kind = graph_sampled | eager_sampled | graph
    sglang_h20:expert_balancedness{layer,rank}     gauge, last sampled pass
    sglang_h20:expert_remote_share{layer,rank}     gauge, last sampled pass (EP > 1)
    sglang_h20:token_leave_share{layer,rank}       gauge, last sampled pass (EP > 1)
    sglang_h20:observe_samples_total{rank,kind}    counter
"""
from __future__ import annotations

import glob
import json
import logging
import os
from pathlib import Path
from typing import Iterable

log = logging.getLogger("sglang_h20.observe")

SCHEMA = 1
DEFAULT_DIR = "sglang_h20_observe"  # relative to the server's working directory
MAX_BYTES = 64 << 20  # rotate a rank's dump beyond this
KEEP = 4  # rotated files kept per rank (name.jsonl.1 .. .KEEP)
STEP_BUCKETS_MS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 250, 1000)


# ----------------------------------------------------------------------------- JSON lines
class JsonlWriter:
    """Append one JSON line per record to <dir>/observe-rank<r>.jsonl, rotating by size."""

    def __init__(self, directory, rank: int, max_bytes: int = MAX_BYTES, keep: int = KEEP,
                 prefix: str = "observe"):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"{prefix}-rank{int(rank):03d}.jsonl"
        self.max_bytes, self.keep = int(max_bytes), int(keep)
        self._fh = None

    def write(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"
        if self._fh is None:
            self._fh = open(self.path, "a", encoding="utf-8")
        if self._fh.tell() > 0 and self._fh.tell() + len(line) > self.max_bytes:
            self._rotate()
        self._fh.write(line)
        self._fh.flush()  # a line is whole on disk before the next one starts

    def _rotate(self) -> None:
        self._fh.close()
        for i in range(self.keep - 1, 0, -1):
            src = self.path.with_name(f"{self.path.name}.{i}")
            if src.exists():
                src.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
        if self.keep > 0:
            self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink()
        self._fh = open(self.path, "a", encoding="utf-8")

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def write_dump(path, records: Iterable[dict]) -> Path:
    """All records into one JSON-lines file (synth, tests)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, separators=(",", ":"), allow_nan=False) + "\n")
    tmp.replace(path)
    return path


def dump_files(paths) -> list[Path]:
    """Files behind the given paths: a directory means its *.jsonl* files (rotated ones too)."""
    files: list[Path] = []
    for p in [paths] if isinstance(paths, (str, Path)) else paths:
        p = Path(p)
        if p.is_dir():
            files += sorted(Path(f) for f in glob.glob(str(p / "*.jsonl*")) if not f.endswith(".tmp"))
        else:
            files.append(p)
    return files


def read_dump(paths, errors: list | None = None) -> list[dict]:
    """Every record in the dumps, sorted by (step, rank, kind). Bad lines are skipped and, if
    `errors` is given, described there (a line cut short by a killed process is the usual one)."""
    records = []
    for f in dump_files(paths):
        with open(f, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError as e:
                    if errors is not None:
                        errors.append(f"{f}:{n}: {e}")
                    continue
                if not isinstance(r, dict) or "step" not in r or "rank" not in r:
                    if errors is not None:
                        errors.append(f"{f}:{n}: not an observe record")
                    continue
                r.setdefault("kind", "stages")
                records.append(r)
    records.sort(key=lambda r: (r["step"], r["rank"], r["kind"]))
    return records


def stage_totals(record: dict) -> dict[str, float]:
    """Per-stage ms of one record summed over layers (overlap stages under 'overlap:<name>')."""
    out: dict[str, float] = {}
    for entry in record.get("layers", ()):
        for k, v in entry.get("stages", {}).items():
            out[k] = out.get(k, 0.0) + v
        for k, v in entry.get("overlap", {}).items():
            out["overlap:" + k] = out.get("overlap:" + k, 0.0) + v
    for k, v in record.get("outside", {}).items():
        out[k] = out.get(k, 0.0) + v
    return out


# ----------------------------------------------------------------------------- Prometheus
def metrics_enabled() -> bool:
    """True when this SGLang process runs with --enable-metrics."""
    try:
        from sglang.srt.runtime_context import get_observability

        return bool(get_observability().enable_metrics)
    except Exception:
        # The launcher sets PROMETHEUS_MULTIPROC_DIR only with --enable-metrics.
        return "PROMETHEUS_MULTIPROC_DIR" in os.environ


class PrometheusExporter:
    """The sglang_h20:* series. `prom` is the prometheus_client module (injectable for tests);
    `registry` None = the default registry, which multiprocess mode writes to its files."""

    def __init__(self, prom=None, registry=None):
        if prom is None:
            import prometheus_client as prom  # ImportError: caller decides
        self.prom = prom
        kw = {} if registry is None else {"registry": registry}
        self.stage_ms = self._gauge("sglang_h20:stage_ms", "Stage time of the last sampled decode pass (ms)",
                                    ["layer", "stage", "rank"], kw)
        self.step_stage_ms = prom.Histogram("sglang_h20:step_stage_ms",
                                            "Stage time per sampled decode pass, summed over layers (ms)",
                                            labelnames=["stage", "rank"], buckets=STEP_BUCKETS_MS, **kw)
        self.step_ms = self._gauge("sglang_h20:step_ms", "Step time of the last sampled pass (ms)",
                                   ["rank", "kind"], kw)
        self.balancedness = self._gauge("sglang_h20:expert_balancedness",
                                        "mean/max per-rank expert load of the last sampled pass",
                                        ["layer", "rank"], kw)
        self.remote_share = self._gauge("sglang_h20:expert_remote_share",
                                        "share of this rank's routed tokens sent to another EP rank, last sampled pass",
                                        ["layer", "rank"], kw)
        self.token_leave = self._gauge("sglang_h20:token_leave_share",
                                       "share of this rank's tokens with an expert on another EP rank, last sampled "
                                       "pass", ["layer", "rank"], kw)
        self.samples = prom.Counter("sglang_h20:observe_samples", "Sampled passes exported",
                                    labelnames=["rank", "kind"], **kw)

    def _gauge(self, name, doc, labels, kw):
        try:
            return self.prom.Gauge(name, doc, labelnames=labels, multiprocess_mode="mostrecent", **kw)
        except (TypeError, ValueError) as e:
            if "multiprocess_mode" not in str(e) and "Invalid multiprocess mode" not in str(e):
                raise
            # prometheus_client < 0.17 has no "mostrecent"
            return self.prom.Gauge(name, doc, labelnames=labels, multiprocess_mode="all", **kw)

    def observe(self, record: dict) -> None:
        rank = str(record.get("rank", 0))
        kind = record.get("kind", "stages")
        self.samples.labels(rank=rank, kind=kind).inc()
        if kind == "graph":
            self.step_ms.labels(rank=rank, kind="graph").set(record["step_ms"])
            return
        self.step_ms.labels(rank=rank, kind="graph_sampled" if record.get("graph_sampled") else "eager_sampled"
                            ).set(record["step_ms"])
        for entry in record.get("layers", ()):
            layer = str(entry["layer"])
            for stage, ms in entry.get("stages", {}).items():
                self.stage_ms.labels(layer=layer, stage=stage, rank=rank).set(ms)
            for stage, ms in entry.get("overlap", {}).items():
                self.stage_ms.labels(layer=layer, stage="overlap:" + stage, rank=rank).set(ms)
        for stage, ms in stage_totals(record).items():
            self.step_stage_ms.labels(stage=stage, rank=rank).observe(ms)
        for layer, b in zip(record.get("expert_load_layers", ()), record.get("balancedness", ())):
            self.balancedness.labels(layer=str(layer), rank=rank).set(b)
        for layer, share in zip(record.get("expert_load_layers", ()), record.get("remote_share", ())):
            self.remote_share.labels(layer=str(layer), rank=rank).set(share)
        for layer, share in zip(record.get("expert_load_layers", ()), record.get("token_leave_share", ())):
            self.token_leave.labels(layer=str(layer), rank=rank).set(share)


_PROCESS_PROM: PrometheusExporter | None = None  # the default registry takes each name once


class Exporter:
    """Sends each finished record to the JSON-lines writer and, if metrics are on, Prometheus.
    Neither may break serving: an error turns that sink off with one warning."""

    def __init__(self, writer: JsonlWriter | None = None, prom: PrometheusExporter | None = None):
        self.writer, self.prom = writer, prom

    @classmethod
    def for_process(cls, out_dir: str | None, rank: int) -> "Exporter":
        global _PROCESS_PROM
        writer = JsonlWriter(out_dir or DEFAULT_DIR, rank)
        prom = None
        if metrics_enabled():
            try:
                if _PROCESS_PROM is None:
                    _PROCESS_PROM = PrometheusExporter()
                prom = _PROCESS_PROM
            except ImportError:
                log.warning("observe: --enable-metrics is on but prometheus_client does not import; "
                            "JSON dumps only")
            except Exception as e:
                log.warning("observe: Prometheus series not registered (%s: %s)", type(e).__name__, e)
        log.info("observe: rank %d writes %s%s", rank, writer.path,
                 " and sglang_h20:* on /metrics" if prom else "")
        return cls(writer, prom)

    def emit(self, record: dict) -> None:
        record.setdefault("schema", SCHEMA)
        if self.writer is not None:
            try:
                self.writer.write(record)
            except Exception as e:
                log.warning("observe: dump writing off (%s: %s)", type(e).__name__, e)
                self.writer = None
        if self.prom is not None:
            try:
                self.prom.observe(record)
            except Exception as e:
                log.warning("observe: Prometheus export off (%s: %s)", type(e).__name__, e)
                self.prom = None
