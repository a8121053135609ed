"""The nightly benchmark matrix: a TOML file, checked strictly so a typo fails before any GPU time is spent."""
from __future__ import annotations

import dataclasses
import re
import shlex
import tomllib
from pathlib import Path

from sglang_h20 import settings

SHIPPED_DIR = Path(__file__).with_name("configs")
DIRECTIONS = ("higher", "lower")
DEFAULT_REPEATS = 3
DEFAULT_REL = 0.03  # smallest relative change ever called a regression
DEFAULT_NOISE_K = 3.0  # tolerance in multiples of the measured run-to-run noise

# What bench_serving reports per serving point (its record keys), and decode-only throughput from the server log.
SERVING_METRICS = {
    "output_throughput": "higher",
    "median_itl_ms": "lower",
    "p99_itl_ms": "lower",
    "median_ttft_ms": "lower",
    "decode_tok_s": "higher",
}
MODELS_PLACEHOLDER = "{models}"
OUT_PLACEHOLDER = "{out}"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]*$")


class ConfigError(ValueError):
    """The config file is unreadable or invalid; the message names the file and the offending entry."""


@dataclasses.dataclass(frozen=True)
class Threshold:
    rel: float = DEFAULT_REL
    noise_k: float = DEFAULT_NOISE_K


@dataclasses.dataclass(frozen=True)
class KernelBench:
    """A shell command that writes one JSON object of numeric metrics to the file `{out}`."""

    name: str
    command: str
    metrics: dict[str, str]  # metric -> "higher" | "lower" (which way is better)

    @property
    def point_id(self) -> str:
        return f"kernel/{self.name}"

    def command_for(self, out, models: str | None) -> str:
        """The command with `{out}` (quoted) and `{models}` filled in; `{models}` without a models root is an
        error."""
        cmd = self.command.replace(OUT_PLACEHOLDER, shlex.quote(str(out)))
        if MODELS_PLACEHOLDER not in cmd:
            return cmd
        if not models:
            raise ConfigError(f"kernel {self.name!r}: command {self.command!r} needs --models DIR")
        return cmd.replace(MODELS_PLACEHOLDER, shlex.quote(str(models).rstrip("/")))


@dataclasses.dataclass(frozen=True)
class ServingPoint:
    concurrency: int
    input_len: int
    output_len: int
    num_prompts: int


@dataclasses.dataclass(frozen=True)
class ServingBench:
    """One server launch (model, args, env) benchmarked at several load points."""

    name: str
    model: str
    server_args: list[str]
    env: dict[str, str]
    points: list[ServingPoint]

    def point_id(self, point: ServingPoint) -> str:
        return f"serving/{self.name}/c{point.concurrency}"

    def model_path(self, models: str | None) -> str:
        """The model folder with `{models}` filled in; a placeholder without a models root is an error."""
        if MODELS_PLACEHOLDER not in self.model:
            return self.model
        if not models:
            raise ConfigError(f"serving {self.name!r}: model {self.model!r} needs --models DIR")
        return self.model.replace(MODELS_PLACEHOLDER, str(models).rstrip("/"))


@dataclasses.dataclass(frozen=True)
class Config:
    name: str
    gpu: str  # expected GPU label, e.g. "H200" or "H20"
    repeats: int
    threshold: Threshold
    kernels: list[KernelBench]
    serving: list[ServingBench]
    source: str = ""


def shipped() -> list[str]:
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.toml"))


def load(spec: str | Path) -> Config:
    """Load a config by path, or by the name of a shipped one ('h200', 'h20')."""
    path = Path(spec)
    if str(spec) in shipped():
        path = SHIPPED_DIR / f"{spec}.toml"
    if not path.is_file():
        raise ConfigError(f"no such config file: {spec} (shipped configs: {', '.join(shipped())})")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None
    return parse(data, source=str(path))


def parse(data: dict, source: str = "<config>") -> Config:
    """Validate a decoded TOML document into a Config; every error message starts with `source`."""
    try:
        return _parse(data, source)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def _parse(data: dict, source: str) -> Config:
    _keys(data, "top level", required=("name", "gpu"), optional=("repeats", "threshold", "kernel", "serving"))
    th = _table(data.get("threshold", {}), "threshold")
    _keys(th, "threshold", required=(), optional=("rel", "noise_k"))
    threshold = Threshold(rel=_number(th.get("rel", DEFAULT_REL), "threshold.rel"),
                          noise_k=_number(th.get("noise_k", DEFAULT_NOISE_K), "threshold.noise_k"))
    kernels = [_kernel(e, f"kernel[{i}]") for i, e in enumerate(_list(data.get("kernel", []), "kernel"))]
    serving = [_serving(e, f"serving[{i}]") for i, e in enumerate(_list(data.get("serving", []), "serving"))]
    if not kernels and not serving:
        raise ConfigError("no [[kernel]] or [[serving]] entries: nothing to run")
    ids = [k.point_id for k in kernels] + [s.point_id(p) for s in serving for p in s.points]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(f"duplicate point ids (names or concurrencies repeat): {', '.join(dupes)}")
    return Config(name=_str(data["name"], "name"), gpu=_str(data["gpu"], "gpu"),
                  repeats=_int(data.get("repeats", DEFAULT_REPEATS), "repeats"),
                  threshold=threshold, kernels=kernels, serving=serving, source=source)


def _kernel(entry, where: str) -> KernelBench:
    entry, where = _entry(entry, where)
    _keys(entry, where, required=("name", "command", "metrics"), optional=())
    name = _name(entry["name"], where)
    metrics = _table(entry["metrics"], f"{where}: metrics")
    if not metrics:
        raise ConfigError(f"{where}: metrics is empty; give metric = \"higher\" or \"lower\"")
    for metric, better in metrics.items():
        if better not in DIRECTIONS:
            raise ConfigError(f"{where}: metric {metric!r}: direction must be \"higher\" or \"lower\" "
                              f"(which way is better), got {better!r}")
    command = _str(entry["command"], f"{where}: command")
    if OUT_PLACEHOLDER not in command:
        raise ConfigError(f"{where}: command must contain {OUT_PLACEHOLDER}, the file it writes its JSON metrics to")
    return KernelBench(name=name, command=command, metrics=dict(metrics))


def _serving(entry, where: str) -> ServingBench:
    entry, where = _entry(entry, where)
    _keys(entry, where, required=("name", "model", "points"), optional=("server_args", "env"))
    name = _name(entry["name"], where)
    args = _list(entry.get("server_args", []), f"{where}: server_args")
    env = _table(entry.get("env", {}), f"{where}: env")
    points = _list(entry["points"], f"{where}: points")
    if not points:
        raise ConfigError(f"{where}: points is empty")
    bench = ServingBench(name=name, model=_str(entry["model"], f"{where}: model"),
                         server_args=[_str(a, f"{where}: server_args[{i}]") for i, a in enumerate(args)],
                         env={k: _env_value(k, v, f"{where}: env") for k, v in env.items()},
                         points=[_point(p, f"{where}: points[{i}]") for i, p in enumerate(points)])
    cap = _graph_cap(bench.server_args, where)
    eager = sorted({p.concurrency for p in bench.points if cap is not None and p.concurrency > cap})
    if eager:
        raise ConfigError(f"{where}: points at concurrency {', '.join(map(str, eager))} exceed --cuda-graph-max-bs "
                          f"{cap}: they would decode without CUDA graphs, mostly host time; raise the cap (or say "
                          f"--disable-cuda-graph to measure eager decoding on purpose)")
    return bench


def _graph_cap(args: list[str], where: str) -> int | None:
    """The largest decode batch the server's CUDA graphs cover, when server_args cap it (None: SGLang's own)."""
    for i, a in enumerate(args):
        flag, _, value = a.partition("=")
        if flag in ("--cuda-graph-max-bs", "--cuda-graph-max-bs-decode"):
            value = value or (args[i + 1] if i + 1 < len(args) else "")
            try:
                return int(value)
            except ValueError:
                raise ConfigError(f"{where}: {flag} needs an integer, got {value!r}") from None
    return None


def _entry(entry, where: str) -> tuple[dict, str]:
    """The entry as a table, and its location with its name when it has one: "serving[1] 'dsv3-4l/off'"."""
    entry = _table(entry, where)
    name = entry.get("name")
    return entry, f"{where} {name!r}" if isinstance(name, str) else where


def _point(entry, where: str) -> ServingPoint:
    fields = [f.name for f in dataclasses.fields(ServingPoint)]
    entry = _table(entry, where)
    _keys(entry, where, required=fields, optional=())
    values = {f: _int(entry[f], f"{where}: {f}") for f in fields}
    return ServingPoint(**values)


def _env_value(key: str, value, where: str) -> str:
    """Env values are strings; SGLANG_H20_* ones must name a real switch and hold a value it accepts."""
    value = _str(value, f"{where}: {key}")
    if key.startswith(settings.ENV_PREFIX):
        switch = next((s for s in settings.SWITCHES if s.env == key), None)
        if switch is None:
            known = ", ".join(s.env for s in settings.SWITCHES)
            raise ConfigError(f"{where}: {key} is not a plugin switch (known: {known})")
        try:
            switch.parse(value)
        except settings.SettingError as e:
            raise ConfigError(f"{where}: {key}={value!r}: {e}") from None
    return value


def _keys(table: dict, where: str, required, optional) -> None:
    unknown = sorted(set(table) - set(required) - set(optional))
    if unknown:
        allowed = ", ".join(sorted([*required, *optional]))
        raise ConfigError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))} (allowed: {allowed})")
    missing = [k for k in required if k not in table]
    if missing:
        raise ConfigError(f"{where}: missing required key(s) {', '.join(map(repr, missing))}")


def _table(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a table, got {type(value).__name__} {value!r}")
    return value


def _list(value, where: str) -> list:
    if not isinstance(value, list):
        raise ConfigError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
    return value


def _str(value, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _name(value, where: str) -> str:
    value = _str(value, f"{where}: name")
    if not _NAME.match(value):
        raise ConfigError(f"{where}: name {value!r} may hold only letters, digits and . _ / -")
    return value


def _int(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: expected a positive integer, got {value!r}")
    return value


def _number(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"{where}: expected a number >= 0, got {value!r}")
    return float(value)
