"""Drive a real `python -m sglang.launch_server` and `sglang.bench_serving` from Python.

Shared by the GPU check (scripts/gpu_check.sh), the end-to-end benchmarks and the nightly runner,
so that every serving number in this project comes from one launcher and one parser.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

DECODE_LINE = re.compile(
    r"Decode batch.*?#running-req:\s*(?P<running>\d+)(?:.*?cuda graph:\s*(?P<graph>True|False))?"
    r".*?gen throughput \(token/s\):\s*(?P<tput>[0-9.]+)(?:.*?#queue-req:\s*(?P<queued>\d+))?"
)
PREFILL_LINE = re.compile(r"Prefill batch.*?#new-token:\s*(?P<new>\d+),\s*#cached-token:\s*(?P<cached>\d+)")


def _say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


PORT_TAKEN = "EADDRINUSE"  # torch.distributed's store could not bind the port SGLang drew


class PortTakenError(RuntimeError):
    """The server died before ready because a port it drew was already in use (its log says EADDRINUSE)."""


CRASH_MARK = "Scheduler hit an exception"
ERROR_LINE = re.compile(r"^(?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception): .+")


def stop_servers_on_sigterm() -> None:
    """Make SIGTERM (`timeout`'s signal) raise SystemExit in this process, so every `with Server(...)` block
    stops its server's process group on the way out instead of leaving it holding the GPU for the next step."""
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))


def crash_summary(log_text: str) -> str | None:
    """The error that ended a server, from its log: the first `SomeError: message` line after SGLang's
    scheduler-crash mark (or anywhere, without the mark); None when the log shows none. A CUDA fault is
    reported where it is noticed, not where it happened, so this names the symptom, not the faulting kernel."""
    start = log_text.find(CRASH_MARK)
    for line in log_text[max(start, 0):].splitlines():
        if ERROR_LINE.match(line.strip()):
            return line.strip()
    return None


class Server:
    """A launched SGLang server: start, wait for /health, stop with its whole process tree.

    Use as a context manager. `log_path` receives stdout+stderr; `env` adds to os.environ.
    SGLANG_H20_PORT_OFFSET shifts the port, so jobs on different GPUs of one host do not collide.
    `hang_s`: a bench during which the log stays silent that long ends the server with every thread's
    Python stack in the log (`dump_stacks`): a hung server then says where it waits instead of a timeout.
    """

    def __init__(self, model: str, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 port: int = 30000, ready_timeout_s: float = 600, hang_s: float | None = None):
        port += int(os.environ.get("SGLANG_H20_PORT_OFFSET", "0"))
        self.model, self.args, self.log_path, self.port = model, list(args), Path(log_path), port
        # faulthandler acts only on fatal signals: a crash or dump_stacks prints every thread's stack
        self.env = {**os.environ, "PYTHONFAULTHANDLER": "1", **(env or {})}
        self.ready_timeout_s, self.hang_s = ready_timeout_s, hang_s
        self.hung: str | None = None
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model,
                "--host", "127.0.0.1", "--port", str(self.port), *self.args]

    def __enter__(self) -> "Server":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return self._launch()
        except PortTakenError:  # SGLang draws its internal ports at random: a taken one is worth one relaunch
            _say("server died on a port already in use (EADDRINUSE); relaunching once")
            return self._launch()

    def _launch(self) -> "Server":
        _say(f"launch: {' '.join(self.command)}")
        t0 = time.time()
        self.log_path.write_text("")  # then append mode: the hang watch's note lands after the output
        self._log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=self.env, start_new_session=True)
        while time.time() - t0 < self.ready_timeout_s:
            if self.proc.poll() is not None:
                self._log.close()
                taken = PORT_TAKEN in self.log_path.read_text(errors="replace")
                raise (PortTakenError if taken else RuntimeError)(
                    f"server exited with {self.proc.returncode} before ready; "
                    f"last log lines:\n{tail(self.log_path, 30)}" + (f"\n({PORT_TAKEN})" if taken else ""))
            if _http_status(self.url + "/health") == 200:
                self.start_s = time.time() - t0
                _say(f"server ready after {self.start_s:.0f}s")
                return self
            time.sleep(2)
        self.__exit__(None, None, None)
        raise TimeoutError(f"server not ready after {self.ready_timeout_s:.0f}s; log tail:\n{tail(self.log_path, 30)}")

    def __exit__(self, *exc) -> None:
        if self.proc and self.proc.poll() is None:
            for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if getattr(self, "_log", None):
            self._log.close()

    def dump_stacks(self, why: str) -> None:
        """End every server process with SIGABRT: faulthandler writes each thread's Python stack into the
        log first. `nvidia-smi` goes there too (a GPU spinning at 100% points at a device-side wait)."""
        self.hung = why
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used",
                                  "--format=csv,noheader"], capture_output=True, text=True, check=False, timeout=20)
            gpus = " | ".join((smi.stdout or smi.stderr).strip().splitlines())
        except (OSError, subprocess.TimeoutExpired) as e:
            gpus = f"not read ({type(e).__name__})"
        with open(self.log_path, "a") as f:
            f.write(f"\n[sglang-h20 hang watch] {why}; nvidia-smi: {gpus}\n")
        _say(f"hang: {why}; dumping stacks into {self.log_path}")
        # one process at a time, deepest first (the schedulers): dumps written at once interleave in the log
        for pid in [*reversed(_descendants(self.proc.pid)), self.proc.pid]:
            with open(self.log_path, "a") as f:
                f.write(f"\n[sglang-h20 hang watch] stacks of pid {pid}:\n")
            try:
                os.kill(pid, signal.SIGABRT)
            except ProcessLookupError:
                continue
            time.sleep(1.0)

    def _watch(self, done: threading.Event) -> None:
        """Dump stacks once the log has not grown for hang_s while `done` is unset and the server lives."""
        size, since = -1, time.monotonic()
        while not done.wait(2.0):
            now = self.log_path.stat().st_size if self.log_path.exists() else 0
            if now != size:
                size, since = now, time.monotonic()
            elif time.monotonic() - since > self.hang_s and self.death() is None:
                self.dump_stacks(f"log silent for {self.hang_s:.0f} s during a bench")
                return

    def death(self) -> str | None:
        """None while the server process runs; once it has exited, the error that ended it (crash_summary),
        so a caller can tell a dead server from a failed client and stop sending it work."""
        if self.proc is None or self.proc.poll() is None:
            return None
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return crash_summary(text) or f"server exited with {self.proc.returncode}"

    def generate(self, text: str | None = None, input_ids: list[int] | None = None,
                 max_new_tokens: int = 32) -> dict:
        """One greedy /generate call; returns SGLang's JSON (output_ids under meta/top level)."""
        prompt = {"input_ids": input_ids} if input_ids is not None else {"text": text}
        return self._generate(prompt, max_new_tokens)

    def warm_up(self, num_prompts: int, input_len: int, output_len: int, concurrency: int, seed: int = 0) -> float:
        """`num_prompts` greedy requests of `input_len` random token ids, `concurrency` at a time, before a timed
        bench: JIT kernels and batch shapes of that concurrency, without a bench_serving client (whose start,
        importing sglang, took ~20 s of a device call per warm-up). Returns its wall seconds."""
        rng = random.Random(seed)
        prompts = [[rng.randrange(100, 129000) for _ in range(input_len)] for _ in range(num_prompts)]
        t0 = time.time()
        with self._watched(), concurrent.futures.ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            for _ in pool.map(lambda ids: self.generate(input_ids=ids, max_new_tokens=output_len), prompts):
                pass  # a failed request raises here (a hung server's stack dump ends it, and so its requests)
        return time.time() - t0

    def generate_batch(self, texts: list[str], max_new_tokens: int = 1, return_logprob: bool = False) -> list[dict]:
        """One batched greedy /generate call: all texts reach the scheduler together."""
        return self._generate({"text": texts, "return_logprob": return_logprob}, max_new_tokens)

    def post(self, path: str, body: dict | None = None, timeout: float = 600) -> str:
        """POST a JSON body to one of the server's endpoints (e.g. /start_profile); returns the reply text."""
        req = urllib.request.Request(self.url + path, data=json.dumps(body or {}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read().decode(errors="replace")

    def _generate(self, body: dict, max_new_tokens: int):
        body = {**body, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}}
        req = urllib.request.Request(self.url + "/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def bench(self, out_jsonl: Path, *, num_prompts: int, input_len: int, output_len: int,
              concurrency: int | None = None, dataset_path: str | None = None, seed: int = 1,
              extra: list[str] | None = None, timeout_s: float = 600, flush_cache: bool = True) -> dict:
        """Run `python -m sglang.bench_serving` against this server; returns its result record."""
        with self._watched():
            return run_bench_serving(self.url, self.model, out_jsonl, num_prompts=num_prompts,
                                     input_len=input_len, output_len=output_len, concurrency=concurrency,
                                     dataset_path=dataset_path, seed=seed, extra=extra, timeout_s=timeout_s,
                                     env=self.env, flush_cache=flush_cache)

    @contextlib.contextmanager
    def _watched(self):
        """The hang watch (hang_s) around a bench or a warm-up."""
        done = threading.Event()
        if self.hang_s:
            threading.Thread(target=self._watch, args=(done,), daemon=True, name="server-hang-watch").start()
        try:
            yield
        finally:
            done.set()


def _descendants(pid: int) -> list[int]:
    """Child processes of `pid`, breadth first (from /proc: no psutil needed)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        kids = sorted(children.get(todo.pop(0), []))
        out += kids
        todo += kids
    return out


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception:
        return 0


def tail(path: Path, n: int) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def log_since(path: Path, offset: int) -> str:
    """The part of a log written after byte `offset` (its size before a bench: that bench's lines)."""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def output_ids(response: dict) -> list[int]:
    """The generated token ids of a /generate response (SGLang puts them at the top level)."""
    ids = response.get("output_ids")
    if ids is None:
        ids = response.get("meta_info", {}).get("output_ids")
    if ids is None:
        raise KeyError(f"no output_ids in /generate response keys {sorted(response)}")
    return list(ids)


GRAPH_FLAGS = ("--cuda-graph-max-bs", "--cuda-graph-max-bs-decode", "--cuda-graph-bs", "--cuda-graph-bs-decode",
               "--disable-cuda-graph", "--cuda-graph-config")


def graphs_up_to(server_args: str, concurrency: int) -> str:
    """`server_args` with `--cuda-graph-max-bs concurrency` added, unless they already set the decode graphs.

    A batch above the largest captured size decodes eagerly: dsv3-ep16-slice (61 layers) stepped at 146-218 ms
    at batch 128 that way (H200, 2026-12-02) against ~30 ms with graphs at batch 48, mostly Python and kernel
    launches rather than the kernels a benchmark compares. SGLang 0.5.17 captures up to 256 by itself on an
    H200/H20 at tp < 4; a benchmark caps it to save start time, so it must not cap below its concurrency.
    """
    words = server_args.split()
    if any(w.split("=", 1)[0] in GRAPH_FLAGS for w in words):
        return server_args
    return f"{server_args} --cuda-graph-max-bs {concurrency}"


SMALL_GPU_MEM_FRACTION = 0.88  # below LARGE_GPU_BYTES: an 80 GB H100 (dsv3-ep16-slice's weights take 0.74 of it)
LARGE_GPU_BYTES = 100 * 2**30   # the H200s (141 GB) most records used, where the scripts' 0.6 was set


def with_mem_fraction(server_args: str, fraction: float | None = None) -> str:
    """`server_args` with their --mem-fraction-static replaced by `fraction`; None: keep theirs on a GPU of at least
    100 GiB, else SMALL_GPU_MEM_FRACTION (an H100's server refused the scripts' 0.6 on dsv3-ep16-slice: "Loaded
    weights leave no GPU memory for the KV cache", session 29). Without a visible GPU, None keeps them as they are."""
    if fraction is None:
        try:
            import torch
            if not torch.cuda.is_available() or torch.cuda.get_device_properties(0).total_memory >= LARGE_GPU_BYTES:
                return server_args
        except Exception:  # no torch / no driver here: the server will say what it needs
            return server_args
        fraction = SMALL_GPU_MEM_FRACTION
    flags = re.sub(r"\s*--mem-fraction-static[ =]\S+", "", server_args)
    return f"{flags} --mem-fraction-static {fraction}".strip()


def write_sharegpt(path: Path, n: int = 400, seed: int = 0) -> Path:
    """bench_serving's random dataset samples from a ShareGPT file; the host has none, so write one.

    Words are 'w<id>' tokens of the generated tokenizer (scripts/make_model.py), one token each.
    """
    import random

    from sglang_h20.models import random_words

    rng = random.Random(seed)
    convs = [{"conversations": [{"from": "human", "value": random_words(rng, rng.randint(300, 600))},
                                {"from": "gpt", "value": random_words(rng, rng.randint(50, 200))}]} for _ in range(n)]
    Path(path).write_text(json.dumps(convs))
    return Path(path)


def run_bench_serving(url: str, model: str, out_jsonl: Path, *, num_prompts: int, input_len: int,
                      output_len: int, concurrency: int | None = None, dataset_path: str | None = None,
                      seed: int = 1, extra: list[str] | None = None, timeout_s: float = 600,
                      env: dict | None = None, flush_cache: bool = True) -> dict:
    """One bench_serving run; by default its measured part starts from an empty prefix cache.

    Every run with the same seed and input length sends the same prompts (bench_serving shuffles the
    dataset with the seed), and bench_serving itself sends prompt 0 as its warm-up. Without
    `--flush-cache` (which empties the radix cache after that warm-up) a run after our own warm-up,
    or after another workload of the same input length, serves most of its prefill from the cache:
    TTFT and output tok/s then describe cached prefixes, not the workload named.
    """
    out_jsonl = Path(out_jsonl)
    if out_jsonl.exists():
        out_jsonl.unlink()
    host, port = url.rsplit("//", 1)[1].split(":")
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--host", host, "--port", port,
           "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len",
           str(output_len), "--random-range-ratio", "1.0", "--num-prompts", str(num_prompts),
           "--tokenizer", model, "--model", model, "--seed", str(seed), "--output-file", str(out_jsonl)]
    if dataset_path:
        cmd += ["--dataset-path", dataset_path]
    if concurrency:
        cmd += ["--max-concurrency", str(concurrency)]
    if flush_cache:
        cmd.append("--flush-cache")
    cmd += extra or []
    _say(f"bench: {' '.join(cmd)}")
    log = out_jsonl.with_suffix(".log")
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s, env=env).returncode
    if rc != 0 or not out_jsonl.exists():
        raise RuntimeError(f"bench_serving failed (rc={rc}); log tail:\n{tail(log, 25)}")
    record = json.loads(out_jsonl.read_text().strip().splitlines()[-1])
    record["command"] = " ".join(cmd)
    return record


def prefill_tokens(log_text: str) -> dict:
    """Prompt tokens the server prefilled vs found in its prefix cache, from its 'Prefill batch' log lines.

    A benchmark of fresh prompts should show (almost) no cached tokens: the evidence that a run measured
    the workload it names (see run_bench_serving's flush).
    """
    rows = [(int(m["new"]), int(m["cached"])) for m in PREFILL_LINE.finditer(log_text)]
    new, cached = sum(r[0] for r in rows), sum(r[1] for r in rows)
    return {"batches": len(rows), "new_tokens": new, "cached_tokens": cached,
            "cached_share": cached / (new + cached) if new + cached else None}


def decode_throughput(log_text: str, min_running: int = 1) -> dict:
    """Decode-only throughput from the server's 'Decode batch' log lines (prefill excluded).

    Takes the lines whose running-request count is at least `min_running` (the steady state of a
    run at that concurrency) and reports the median and spread of their gen throughput, and their
    harmonic mean: tokens over time when the lines carry equal token counts, so a rare slow step
    counts in full (the median would skip the lines that hold it).
    Also what explains a run with no steady lines or a slow one: the most requests decoding at once
    (below the concurrency when the KV pool is full: the rest wait in the queue, `max_queued`) and the
    lines decoded without a CUDA graph (a batch above --cuda-graph-max-bs runs eagerly).
    """
    matches = list(DECODE_LINE.finditer(log_text))
    samples = [(int(m["running"]), float(m["tput"])) for m in matches]
    shape = {"max_running": max((r for r, _ in samples), default=0),
             "max_queued": max((int(m["queued"]) for m in matches if m["queued"]), default=0),
             "eager_lines": sum(m["graph"] == "False" for m in matches)}
    steady = [t for r, t in samples if r >= min_running and t > 0]
    if not steady:
        return {"lines": len(samples), "steady_lines": 0, "median_tok_s": None, **shape}
    return {"lines": len(samples), "steady_lines": len(steady), "median_tok_s": statistics.median(steady),
            "mean_tok_s": statistics.harmonic_mean(steady), "min_tok_s": min(steady), "max_tok_s": max(steady),
            **shape}
