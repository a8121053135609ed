"""The per-GPU tuned table of the FP8 grouped GEMMs (grouped_gemm_fp8): which of our variants, or upstream's kernel,
was fastest at each (N, K, experts, tokens per expert, layout) on one GPU, and with which tiles.

Why a module of its own: the kernels' launchers ask it for a tile config (`lookup`), the SGLang hooks ask it
whether to run ours at all (`table_choice`, stricter: upstream whenever unsure), and the benchmark builds it
(`table_from_result`); none of that needs the kernels, and doctor reads it on machines without a GPU.

Files: this user's re-tune, $XDG_CACHE_HOME/sglang_h20/grouped_gemm_<gpu>.json, before the shipped
python/sglang_h20/tables/grouped_gemm_<gpu>.json (SGLANG_H20_GEMM_TABLE=<file> overrides both). Re-tune with
    python benchmark/kernels/bench_grouped_gemm.py --tune
"""
from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import time
from pathlib import Path
from typing import NamedTuple

VARIANTS = ("swapab", "normal")  # one launch, one tile shape
GROUPED_VARIANTS = VARIANTS + ("split",)  # masked / contiguous: also both, split by each group's count


@functools.lru_cache(maxsize=1)
def this_gpu() -> str:
    """This process's GPU name ('cpu' without one): the table a call looks up by default."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return "cpu"


def _table_dir() -> Path:
    """python/sglang_h20/tables, found without importing sglang_h20 (this package stands alone)."""
    spec = importlib.util.find_spec("sglang_h20")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]) / "tables"
    return Path(__file__).resolve().parents[2] / "python" / "sglang_h20" / "tables"


FORM_FACTORS = ("pcie", "nvl")  # words that change bandwidth or clocks: the same chip gets a table of its own


def gpu_key(gpu_name: str) -> str:
    """The file-name key of a GPU's tables: the model word plus its form factor ('NVIDIA H100 80GB HBM3' -> 'h100',
    'NVIDIA H100 PCIe' -> 'h100-pcie', 'NVIDIA H100 NVL' -> 'h100-nvl'). Why the form factor: the same chip has
    other bandwidth and clocks in each (H100 spec sheet: PCIe 2.0, SXM 3.35, NVL 3.9 TB/s), so the SXM part's picks
    are not its picks; it gets no table (upstream, one log line) until it is tuned. Memory size and type words do
    not change the key."""
    words = gpu_name.lower().replace("nvidia", " ").split()
    if not words:
        return "unknown"
    return "-".join([words[0]] + [w for w in words[1:] if w in FORM_FACTORS])


TABLE_ENV = "SGLANG_H20_GEMM_TABLE"  # a table file that overrides the lookup (A/B runs, tests)


def table_path(gpu_name: str) -> Path:
    """The shipped table: tables/grouped_gemm_<gpu>.json ('NVIDIA H200' -> grouped_gemm_h200.json,
    'NVIDIA H20' -> grouped_gemm_h20.json).

    SGLANG_H20_GEMM_TABLE=<file> overrides (for A/B runs and tests).
    """
    if os.environ.get(TABLE_ENV):
        return Path(os.environ[TABLE_ENV])
    return _table_dir() / f"grouped_gemm_{gpu_key(gpu_name)}.json"


def user_table_path(gpu_name: str) -> Path:
    """Where a re-tune on this machine writes (and the loader looks first):
    $XDG_CACHE_HOME (default ~/.cache) /sglang_h20/grouped_gemm_<gpu>.json."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "sglang_h20" / f"grouped_gemm_{gpu_key(gpu_name)}.json"


TABLE_RECHECK_S = 1.0  # how long a found table file (and its mtime) is trusted before the files are looked at again
_found: dict = {}  # (gpu, SGLANG_H20_GEMM_TABLE) -> (monotonic time, path or None, mtime)


def forget_tables() -> None:
    """Look at the table files again on the next call (after writing one, or in tests)."""
    _found.clear()
    _lookup_cached.cache_clear()


def _find(gpu_name: str) -> tuple[Path | None, float]:
    """(file in force, its mtime), from a cache of TABLE_RECHECK_S: each GEMM call of a server asks, and the
    environment reads and two stat calls per call cost more host time than the launch (~140 us with the lookup,
    here). A new SGLANG_H20_GEMM_TABLE counts at once; a new cache root (XDG_CACHE_HOME, HOME) with the files."""
    now = time.monotonic()
    override = os.environ.get(TABLE_ENV)
    hit = _found.get((gpu_name, override))
    if hit is not None and now - hit[0] < TABLE_RECHECK_S:
        return hit[1], hit[2]
    candidates = [table_path(gpu_name)] if override else [user_table_path(gpu_name), table_path(gpu_name)]
    path, mtime = None, 0.0
    for p in candidates:
        try:
            mtime = p.stat().st_mtime
        except OSError:
            continue
        path = p
        break
    _found[(gpu_name, override)] = (now, path, mtime)
    return path, mtime


def find_table(gpu_name: str) -> Path | None:
    """The table file in force: the override if set (even if missing), else this user's re-tune,
    else the shipped one; None if none exists (looked at again at most every TABLE_RECHECK_S)."""
    return _find(gpu_name)[0]


@functools.lru_cache(maxsize=16)
def _load_table_cached(path: str, mtime: float) -> dict | None:
    data = json.loads(Path(path).read_text())
    if not isinstance(data.get("entries"), list):
        raise ValueError(f"{path}: no 'entries' list")
    for e in data["entries"]:
        missing = {"n", "k", "groups", "m", "best"} - set(e)
        if missing:
            raise ValueError(f"{path}: entry {e} lacks {sorted(missing)}")
        if e["best"] not in (*(VARIANTS if e.get("layout") == "dense" else GROUPED_VARIANTS), "upstream"):
            raise ValueError(f"{path}: entry {e} has best={e['best']!r}")
    return {**data, "path": path}


def load_table(gpu_name: str) -> dict | None:
    """The table for this GPU (see `find_table` for which file), or None when there is none.

    Format (one JSON object):
      {"gpu": "NVIDIA H200", "measured": true, "date": "...", "source": {"command": ..., ...},
       "provenance": {...sglang_h20.provenance.record() of the benchmark run},
       "entries": [{"n": 4096, "k": 7168, "groups": 32, "m": 8, "layout": "masked", "best": "swapab",
                    "us": {"swapab": 41.0, "normal": 63.2, "upstream": 55.1},
                    "config": {"swapab": {"BLOCK_N": 64, "BLOCK_T": 16, "num_warps": 4,
                                          "num_stages": 4, "programs_per_sm": 2}, "normal": {...}}}]}
    m is tokens per group; an optional "layout" ("contiguous" | "masked" | "dense") restricts an
    entry to that layout; "best" is "swapab", "normal" or "upstream" (SGLang's own path, DeepGEMM
    or its Triton fused-MoE kernel, was fastest: the caller should not use these kernels there).
    The returned dict also carries "path", the file it came from.

    Produced by benchmark/kernels/bench_grouped_gemm.py (`table_from_result` below):
      python benchmark/kernels/bench_grouped_gemm.py --tune       -> user_table_path(<this GPU>)
      python benchmark/kernels/bench_grouped_gemm.py --table-from RESULTS.json --table-out FILE
    """
    path, mtime = _find(gpu_name)
    if path is None:
        return None
    return _load_table_cached(str(path), mtime)


def lookup(m: int, n: int, k: int, groups: int, gpu_name: str, layout: str | None) -> dict | None:
    """The entry for `groups` experts of about m tokens each: nearest group count in log2, then the smallest
    tabulated m >= m (else the largest); layout keeps entries measured for it (none: any). None without a table."""
    path, mtime = _find(gpu_name)
    if path is None:
        return None
    return _lookup_cached(str(path), mtime, m, n, k, groups, layout)


@functools.lru_cache(maxsize=4096)
def _lookup_cached(path: str, mtime: float, m: int, n: int, k: int, groups: int, layout: str | None) -> dict | None:
    table = _load_table_cached(path, mtime)
    same = [e for e in table["entries"] if e["n"] == n and e["k"] == k
            and (layout is None or e.get("layout") in (None, layout))]
    if not same:
        return None
    gdist = lambda e: abs(math.log2(max(e["groups"], 1)) - math.log2(max(groups, 1)))
    best_g = min(gdist(e) for e in same)
    same = sorted((e for e in same if gdist(e) == best_g), key=lambda e: e["m"])
    for e in same:  # the smallest tabulated m that covers this m, else the largest
        if e["m"] >= m:
            return e
    return same[-1]


# ---------------------------------------------------------------------------------------------
# Ours or upstream, for the SGLang hooks
# ---------------------------------------------------------------------------------------------
class TableChoice(NamedTuple):
    best: str  # 'swapab' | 'normal' | 'split' | 'upstream'
    config: dict | None  # the table's tuned tiles for `best` (None: use the heuristic)
    why: str


def _nearest(values, x: float) -> tuple[list, float]:
    """The values nearest to x in log2 (all of them on a tie) and that distance."""
    dist = {v: abs(math.log2(max(v, 1e-9)) - math.log2(max(x, 1e-9))) for v in values}
    best = min(dist.values())
    return sorted(v for v in dist if dist[v] - best < 1e-9), best


def entry_best(entry: dict, against: str | None = None) -> str:
    """An entry's winner; `against` names the one upstream kernel the caller would otherwise run (e.g.
    'sglang-triton' under --fp8-gemm-backend triton): ours must beat that kernel's measured time, not the
    fastest upstream one (which that server does not run). Without that provider's time: the entry's "best"."""
    upstream_us = (entry.get("upstream_us_by_provider") or {}).get(against) if against else None
    if upstream_us is None:
        return entry["best"]
    times = {v: t for v, t in (entry.get("us") or {}).items() if v in GROUPED_VARIANTS}
    # the uneven draw's "upstream" is its fastest provider: a conservative check for `against`
    return _fastest({**times, "upstream": upstream_us}, entry.get("us_uneven"))


def _fastest(us: dict, uneven: dict | None) -> str:
    """'swapab' | 'normal' | 'split' | 'upstream': the fastest of ours in `us` that beats upstream there (a tie is
    upstream's) and also on the uneven draw, where one was measured; upstream when none does. Each of ours is judged
    on both draws, not only the uniform draw's fastest (session 53: split lost down 16x64's uneven draw by 0.6%, and
    the key went upstream though normal won both)."""
    def beats_upstream(v: str) -> bool:
        on_uneven = not uneven or "upstream" not in uneven or uneven.get(v, math.inf) < uneven["upstream"]
        return us[v] < us.get("upstream", math.inf) and on_uneven
    ours = [v for v in us if v != "upstream" and beats_upstream(v)]
    return min(ours, key=lambda v: (us[v], v)) if ours else "upstream"


def table_choice(m: float, n: int, k: int, groups: float, layout: str,
                 gpu_name: str | None = None, against: str | None = None) -> TableChoice:
    """Ours or upstream for one GEMM shape, from the measured table only; upstream whenever unsure.

    Stricter than `choose_variant` (which serves direct callers of 'auto'), because here a wrong
    "ours" costs serving time: take the measured group count(s) nearest to `groups` in log2, then the
    token count(s) nearest to `m` (both neighbours on a tie, e.g. 16 groups between 8 and 32); ours
    only if every one of those entries names the same variant of ours. Upstream when there is no
    table, no entry for (n, k, layout), or the nearest measured point is over 2x away in groups or m.
    `against`: the upstream provider this caller replaces (`entry_best`); None: the fastest upstream.
    """
    gpu = gpu_name if gpu_name is not None else this_gpu()
    table = load_table(gpu)
    if table is None:
        return TableChoice("upstream", None, f"no grouped-GEMM table for {gpu}")
    same = [e for e in table["entries"] if e["n"] == n and e["k"] == k and e.get("layout") in (None, layout)]
    if not same:
        return TableChoice("upstream", None, f"no {layout} entry for N={n} K={k}")
    near_g, dg = _nearest({e["groups"] for e in same}, groups)
    if dg > 1:
        return TableChoice("upstream", None, f"{groups:.3g} groups: nearest measured {near_g} is over 2x away")
    same = [e for e in same if e["groups"] in near_g]
    near_m, dm = _nearest({e["m"] for e in same}, m)
    if dm > 1:
        return TableChoice("upstream", None, f"m={m:.3g}: nearest measured {near_m} is over 2x away")
    same = [e for e in same if e["m"] in near_m]
    bests = {entry_best(e, against) for e in same}
    where = f"groups {near_g}, m {near_m}"
    if len(bests) != 1 or "upstream" in bests:
        return TableChoice("upstream", None, f"{where}: measured best {sorted(bests)}")
    best = bests.pop()
    return TableChoice(best, same[-1].get("config", {}).get(best), f"{where}: measured best {best}")


# ---------------------------------------------------------------------------------------------
# Building a table from a benchmark run (benchmark/kernels/bench_grouped_gemm.py)
# ---------------------------------------------------------------------------------------------
UPSTREAM_PROVIDERS = ("deepgemm", "sglang-triton", "sglang-triton-swapab")  # what SGLang itself runs
TILE_KEYS = ("BLOCK_N", "BLOCK_T", "num_warps", "num_stages", "maxnreg", "programs_per_sm", "flat", "tma", "ws",
             "split_k", "serial_reduce", "split_at", "split_streams")


def table_entries(points: list[dict]) -> list[dict]:
    """One entry per (n, k, groups, tokens per group, layout) of a bench_grouped_gemm run.

    "us" holds the uniform draw's best time of ours-swapab, ours-normal, ours-split and upstream (the fastest
    of UPSTREAM_PROVIDERS measured in that layout); "best" is the fastest (upstream on a tie).
    Where an uneven draw (same total, Zipf-like expert popularity) was measured at the same key,
    ours must win there too, else "best" is "upstream": real routing is uneven. A tuned variant
    timed on both draws ships one config for both, so its times there are those of the config
    fastest over the two together (`_config_for_both_draws`), not each draw's own fastest. A key
    without an upstream time has no entry (no claim without the comparison). Dense points (layout
    "dense", one group, the attention / shared-expert linears) have one draw, counted as the uniform one.
    """
    slots: dict = {}
    for p in points:
        if p.get("kind") not in ("moe", "dense"):
            continue
        name = {"ours-swapab": "swapab", "ours-normal": "normal", "ours-split": "split"}.get(p["provider"])
        if name is None and p["provider"] not in UPSTREAM_PROVIDERS:
            continue
        name = name or "upstream"
        key = (p["n"], p["k"], p["groups"], p["tokens_per_group"], p["layout"])
        draw = "uniform" if p["distribution"] == "dense" else p["distribution"]  # a dense GEMM has one draw
        d = slots.setdefault(key, {}).setdefault(draw, {"us": {}, "config": {}, "by": {}, "point": {}})
        if name == "upstream":
            d["by"][p["provider"]] = p["us"]
        if name not in d["us"] or p["us"] < d["us"][name]:
            d["us"][name] = p["us"]
            d["point"][name] = p
            if name != "upstream" and p.get("config"):
                d["config"][name] = {kk: p["config"][kk] for kk in TILE_KEYS if kk in p["config"]}
    entries = []
    for (n, k, groups, m, layout), slot in sorted(slots.items()):
        uni, uneven = slot.get("uniform"), slot.get("uneven")
        if uni is None or "upstream" not in uni["us"]:
            continue
        for name in set(uni["point"]) & set(uneven["point"] if uneven else ()) - {"upstream"}:
            both = _config_for_both_draws(uni["point"][name], uneven["point"][name])
            if both:
                uni["us"][name], uneven["us"][name], uni["config"][name] = both
        best = _fastest(uni["us"], uneven and uneven["us"])
        e = {"n": n, "k": k, "groups": groups, "m": m, "layout": layout, "best": best, "us": uni["us"],
             "upstream_us_by_provider": uni["by"], "config": uni["config"]}
        if uneven:
            e["us_uneven"] = uneven["us"]
        entries.append(e)
    return entries


def _trial_times(point: dict) -> dict:
    """A tuned point's trials that passed the error check: their config as given (JSON) -> (µs, tiles run or None).
    Runs since session 38 name each trial's tiles; older ones only the point's fastest trial's (its "config")."""
    ok = [t for t in point.get("trials") or () if "rejected_rel_err" not in t]
    fastest = min(ok, key=lambda t: t["us"], default=None)
    return {json.dumps(t["config"], sort_keys=True):
            (t["us"], t.get("tiles") or (point.get("config") if t is fastest else None)) for t in ok}


def _config_for_both_draws(uniform: dict, uneven: dict) -> tuple | None:
    """(uniform µs, uneven µs, tiles) of the config with the least summed time over a key's two draws, among the
    configs one tuning run timed on both whose tiles are known (a config runs the same tiles on both draws); None
    when the points were not tuned. The table ships one config per key, so it is judged on both draws with it."""
    a, b = _trial_times(uniform), _trial_times(uneven)
    known = {c: a[c][1] or b[c][1] for c in a if c in b and (a[c][1] or b[c][1])}
    if not known:
        return None
    c = min(known, key=lambda c: a[c][0] + b[c][0])
    return a[c][0], b[c][0], {kk: known[c][kk] for kk in TILE_KEYS if kk in known[c]}


def table_from_result(result: dict, results_file: str | None = None, command: str | None = None) -> dict:
    """A table (`load_table` format) from one bench_grouped_gemm results object, with its provenance."""
    prov = result.get("provenance") or {}
    return {
        "gpu": prov.get("gpu"), "measured": True,
        "date": max([prov.get("date") or ""] + [(m.get("provenance") or {}).get("date") or ""
                                                 for m in result.get("merged_from", [])]) or None,  # the latest run's
        "source": {"benchmark_command": prov.get("command"), "results_file": results_file,
                   "table_command": command, "quick": result.get("quick"),
                   **({"merged_from": result["merged_from"]} if result.get("merged_from") else {})},
        "rule": "best = fastest of ours-swapab / ours-normal / ours-split / upstream (fastest of "
                + ", ".join(UPSTREAM_PROVIDERS) + " in that layout) on the uniform draw; ours must also "
                "win the uneven draw where one was measured",
        "provenance": prov, "entries": table_entries(result.get("points", [])),
    }
