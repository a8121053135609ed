"""Execute a config: kernel commands and serving points, each `repeats` times, into one run record.

A failing point is recorded with its error and the run goes on: one broken kernel must not cost
the night's serving numbers. The record is rewritten after every point, so a killed run keeps
what it measured.
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from pathlib import Path

from sglang_h20 import provenance, settings
from sglang_h20.nightly import report, serving
from sglang_h20.nightly.compare import SCHEMA, SKIPPED_PREFIX
from sglang_h20.nightly.config import SERVING_METRICS, Config, KernelBench, ServingBench

KERNEL_TIMEOUT_S = 900
BASE_PORT = 30000
RECORD_NAME = "run.json"
WARMUP = {"num_prompts": 8, "concurrency": 8, "output_len": 32}


def gpu_matches(expected: str, name: str | None) -> bool:
    """'H20' matches 'NVIDIA H20' but not 'NVIDIA H200'."""
    return bool(name) and re.search(rf"(?<![A-Za-z0-9]){re.escape(expected)}(?![A-Za-z0-9])", name, re.I) is not None


def selected(point_id: str, only: str | None) -> bool:
    return not only or only in point_id


def run(config: Config, out_dir: Path, *, models: str | None = None, repeats: int | None = None,
        only: str | None = None, command: str = "") -> dict:
    """Run every selected point of `config`; returns the record, also written to out_dir/run.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    repeats = repeats or config.repeats
    plan = [(i, s, [p for p in s.points if selected(s.point_id(p), only)]) for i, s in enumerate(config.serving)]
    plan = [(i, s, pts) for i, s, pts in plan if pts]
    models_of = {s.name: s.model_path(models) for _, s, _ in plan}  # ConfigError before any GPU work
    kernels = [k for k in config.kernels if selected(k.point_id, only)]
    for k in kernels:
        k.command_for("-", models)  # ConfigError (a {models} command without --models) before any GPU work
    if not kernels and not plan:
        raise ValueError(f"--only {only!r} selects no point of config {config.name!r}")

    record = {"schema": SCHEMA, "config": config.name, **provenance.record(command),
              "repeats": repeats, "threshold": {"rel": config.threshold.rel, "noise_k": config.threshold.noise_k},
              "points": {}}
    if not gpu_matches(config.gpu, record["gpu"]):
        _progress(0, f"WARNING: config {config.name!r} is for {config.gpu}; this host's GPU: {record['gpu']}")
    path = out_dir / RECORD_NAME
    t0 = time.time()

    def save(point_id: str, point: dict) -> None:
        record["points"][point_id] = point
        report.write_record(path, record)

    for k in kernels:
        save(k.point_id, run_kernel(k, repeats, out_dir / "kernels", t0, models))
    sharegpt = None
    for i, s, points in plan:
        if sharegpt is None:  # one dataset for the whole run, sized for its largest point
            n = max(400, *(p.num_prompts for _, _, pts in plan for p in pts))
            sharegpt = serving.write_sharegpt(out_dir / "sharegpt.json", n=n)
        run_serving(s, points, models_of[s.name], BASE_PORT + i, sharegpt, repeats, out_dir, t0, save)
    _progress(t0, f"done: {len(record['points'])} points -> {path}")
    return record


def _progress(t0: float, msg: str) -> None:
    elapsed = time.time() - t0 if t0 else 0.0
    serving._say(f"[+{elapsed / 60:5.1f} min] {msg}")


def _point(kind: str, params: dict) -> dict:
    return {"kind": kind, "params": params, "metrics": {}, "error": None}


def _add(point: dict, metric: str, value: float, better: str) -> None:
    point["metrics"].setdefault(metric, {"values": [], "better": better})["values"].append(value)


def missing_script(command: str, cwd: Path | None = None) -> str | None:
    """The first `*.py` argument of `command` that does not exist (relative to cwd), or None."""
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    base = Path(cwd) if cwd else Path.cwd()
    return next((w for w in words if w.endswith(".py") and not (base / w).is_file()), None)


def run_kernel(k: KernelBench, repeats: int, work_dir: Path, t0: float, models: str | None = None) -> dict:
    """Run the command `repeats` times; every metric of the config must come back as a number."""
    point = _point("kernel", {"command": k.command})
    script = missing_script(k.command)
    if script:
        point["error"] = f"{SKIPPED_PREFIX}not found: {script}"
        _progress(t0, f"{k.point_id}: {point['error']}")
        return point
    work_dir.mkdir(parents=True, exist_ok=True)
    for r in range(repeats):
        out = work_dir / f"{k.name}.r{r}.json"
        out.unlink(missing_ok=True)
        cmd = k.command_for(out, models)
        _progress(t0, f"{k.point_id} repeat {r + 1}/{repeats}: {cmd}")
        try:
            log = work_dir / f"{k.name}.r{r}.log"
            with open(log, "w") as f:
                rc = subprocess.run(cmd, shell=True, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=KERNEL_TIMEOUT_S).returncode
            if rc != 0:
                raise RuntimeError(f"exit status {rc}; log tail:\n{serving.tail(log, 15)}")
            values = _kernel_metrics(out, k.metrics)
        except (OSError, ValueError, RuntimeError, subprocess.TimeoutExpired) as e:
            point["error"] = f"repeat {r + 1}: {type(e).__name__}: {e}"
            _progress(t0, f"{k.point_id} FAILED: {point['error']}")
            break
        for metric, value in values.items():
            _add(point, metric, value, k.metrics[metric])
        _progress(t0, f"{k.point_id} repeat {r + 1}/{repeats}: {_fmt(values)}")
    return point


def _kernel_metrics(out: Path, wanted: dict[str, str]) -> dict[str, float]:
    if not out.is_file():
        raise RuntimeError(f"the command wrote no {out.name}")
    data = json.loads(out.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{out.name} holds {type(data).__name__}, expected one JSON object")
    missing = [m for m in wanted if m not in data]
    if missing:
        raise ValueError(f"{out.name} lacks metric(s) {missing} (has {sorted(data)})")
    bad = {m: data[m] for m in wanted if isinstance(data[m], bool) or not isinstance(data[m], (int, float))}
    if bad:
        raise ValueError(f"{out.name}: non-numeric metric(s) {bad}")
    return {m: float(data[m]) for m in wanted}


def server_env(s: ServingBench) -> dict[str, str]:
    """Every plugin switch pinned to its default unless the config sets it, so that the shell
    running the nightly cannot turn a 'features off' server on."""
    return {**{sw.env: sw.default for sw in settings.SWITCHES}, **s.env}


def run_serving(s: ServingBench, points: list, model: str, port: int, sharegpt: Path, repeats: int,
                out_dir: Path, t0: float, save) -> None:
    """One server for all of the entry's points: warm up once, then bench each point `repeats` times."""
    slug = s.name.replace("/", "_")
    bench_dir = out_dir / "bench"
    bench_dir.mkdir(parents=True, exist_ok=True)
    ids = [s.point_id(p) for p in points]
    params = [{"model": model, "server_args": s.server_args, "env": s.env,
               "concurrency": p.concurrency, "input_len": p.input_len, "output_len": p.output_len,
               "num_prompts": p.num_prompts} for p in points]
    done: set[str] = set()
    _progress(t0, f"serving/{s.name}: starting server on port {port}")
    try:
        with serving.Server(model, s.server_args, out_dir / "logs" / f"{slug}.server.log",
                            env=server_env(s), port=port) as server:
            try:
                first = points[0]
                server.bench(bench_dir / f"{slug}.warmup.jsonl", num_prompts=WARMUP["num_prompts"],
                             concurrency=WARMUP["concurrency"], input_len=first.input_len,
                             output_len=min(WARMUP["output_len"], first.output_len), dataset_path=str(sharegpt))
            except Exception as e:
                raise RuntimeError(f"warm-up bench failed: {e}") from e
            for pid, p, prm in zip(ids, points, params):
                save(pid, bench_point(server, pid, p, prm, repeats, sharegpt, bench_dir, t0))
                done.add(pid)
    except Exception as e:  # launch or warm-up failed: the points not yet measured get the error
        for pid, prm in zip(ids, params):
            if pid not in done:
                point = _point("serving", prm)
                point["error"] = f"server: {type(e).__name__}: {e}"
                save(pid, point)
        _progress(t0, f"serving/{s.name} FAILED: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")


def bench_point(server, pid: str, p, params: dict, repeats: int, sharegpt: Path, bench_dir: Path,
                t0: float) -> dict:
    """`repeats` bench_serving runs at one point; decode_tok_s comes from the server log lines of each run."""
    point = _point("serving", params)
    for r in range(repeats):
        _progress(t0, f"{pid} repeat {r + 1}/{repeats}")
        try:
            if server.proc is not None and server.proc.poll() is not None:
                raise RuntimeError(f"server exited with {server.proc.returncode}; log tail:\n"
                                   f"{serving.tail(server.log_path, 20)}")
            before = _size(server.log_path)
            result = server.bench(bench_dir / f"{pid.replace('/', '_')}.r{r}.jsonl", num_prompts=p.num_prompts,
                                  input_len=p.input_len, output_len=p.output_len, concurrency=p.concurrency,
                                  dataset_path=str(sharegpt))
            new_log = serving.log_since(server.log_path, before)
        except Exception as e:
            point["error"] = f"repeat {r + 1}: {type(e).__name__}: {e}"
            _progress(t0, f"{pid} FAILED: {point['error']}")
            break
        values = {m: float(result[m]) for m in SERVING_METRICS if isinstance(result.get(m), (int, float))}
        decode = serving.decode_throughput(new_log, min_running=p.concurrency)
        if decode["median_tok_s"] is not None:
            values["decode_tok_s"] = decode["median_tok_s"]
        for metric, value in values.items():
            _add(point, metric, value, SERVING_METRICS[metric])
        note = "" if "decode_tok_s" in values else _why_no_decode_rate(decode, p.concurrency)
        _progress(t0, f"{pid} repeat {r + 1}/{repeats}: {_fmt(values)}{note}")
    return point


def _why_no_decode_rate(decode: dict, concurrency: int) -> str:
    """Why a repeat has no decode-only rate: too few requests decoded at once, and whether a full KV pool did it."""
    why = f" (no decode lines with >= {concurrency} running: at most {decode.get('max_running', 0)}"
    if decode.get("max_queued"):
        why += f", up to {decode['max_queued']} queued: the KV pool is full"
    return why + ")"


def _size(path: Path) -> int:
    try:
        return Path(path).stat().st_size
    except OSError:
        return 0


def _fmt(values: dict[str, float]) -> str:
    return ", ".join(f"{k}={v:.4g}" for k, v in values.items())
