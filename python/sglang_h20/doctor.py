"""`python -m sglang_h20 doctor`: versions, GPU, which features would activate here and why, and which tuned
tables and decode kernel this GPU gets (with the command that re-tunes a table here).

It asks the same functions the plugin asks (compat, features.decide, the table loaders, the FP8 MLA backend's
kernel choice), so its answer is the plugin's answer for the current environment. Works on a CPU-only machine.
"""
from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import platform
from pathlib import Path

from sglang_h20 import __version__, compat
from sglang_h20.features import FEATURES, decide
from sglang_h20.plugin import plugin_hooks
from sglang_h20.settings import SWITCHES, Settings


def report(settings: Settings | None = None) -> tuple[str, bool]:
    """The doctor's text, and whether everything the current switches ask for can be honoured."""
    settings = Settings.from_env() if settings is None else settings
    lines = [f"sglang-h20 {__version__} on Python {platform.python_version()} ({platform.machine()})"]
    for dist, tested in (("sglang", compat.TESTED_SGLANG), ("torch", compat.TESTED_TORCH),
                         ("triton", None), ("sglang-kernel", None), ("flashinfer-python", None)):
        v = compat.version(dist)
        note = "" if tested is None or v == tested else f"  (tested: {tested})"
        lines.append(f"  {dist:<18} {v or 'not installed'}{note}")
    ok_gpu, gpu_text = compat.check_gpu()
    lines.append(f"  {'GPU':<18} {gpu_text}" + ("" if ok_gpu else "  -> GPU features fall back to upstream"))
    eps = [e for e in md.entry_points(group="sglang.srt.plugins") if e.name == "sglang_h20"]
    lines.append(f"  {'entry point':<18} " + (eps[0].value if eps else "MISSING: reinstall the package"))
    all_good = bool(eps)
    for hook in plugin_hooks(in_launcher=True):
        ok, why = compat.check_target(hook.target)
        all_good &= ok
        if not ok:
            lines.append(f"  plugin hook        {why}")
    lines.append("switches:")
    width = max(len(s.env) for s in SWITCHES)
    for s in SWITCHES:
        lines.append(f"  {s.env:<{width}} {s.show(settings[s.name]):<10} {s.flag}")
    lines.append("features (what the plugin would do in a server process here):")
    for feature in FEATURES:
        d = decide(feature, settings)
        all_good &= d.on or not feature.wanted(settings) and not any(
            n in settings.errors for n in (feature.switch, *feature.options))
        lines.append(f"  {feature.name:<16} {'ON ' if d.on else 'off'}  {d.reason}")
        if d.on and feature.needs:
            lines.append(f"  {'':<16}      needs {feature.needs}")
    lines += tables_and_kernels(settings)
    return "\n".join(lines), all_good


def _table_line(path: Path | None, retune: str) -> str:
    if path is None or not path.exists():
        return f"none for this GPU; make one here: {retune}"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"{path} unreadable ({type(e).__name__}: {e})"
    how = "measured" if data.get("measured") else "modelled"
    when = str(data.get("date") or data.get("provenance", {}).get("date") or "?")[:10]
    return f"{path.name}, {how} on {data.get('gpu', '?')} ({when}); re-tune here: {retune}"


def tables_and_kernels(settings: Settings | None = None) -> list[str]:
    """The tuned tables in force for this GPU (this machine's re-tune first, else the shipped one), the FP8
    MLA decode kernel the backend would use (on a Hopper GPU with nvcc this builds it once, a few seconds) and
    SBO's per-GPU cap."""
    settings = Settings.from_env() if settings is None else settings
    g = compat.gpu()
    lines = ["tables and kernels (this GPU):"]
    if g is None:
        return lines + ["  no CUDA GPU visible: tables are per GPU, the decode kernel needs one"]
    from sglang_h20.attention import mha_mla

    def fp8_mla_decode() -> str:
        from sglang_h20.attention.fp8_mla_backend import decode_kernel

        return decode_kernel().what

    # the table file names come from the kernel package (gemm_table.gpu_key), whose import needs triton
    return lines + [
        _guarded("MHA/MLA cost table", lambda: _table_line(mha_mla.find_table(g.name),
                                                           "python -m sglang_h20 calibrate mha-mla")),
        _guarded("grouped GEMM table", lambda: _table_line(
            importlib.import_module("sgl_kernel_ext.gemm_table").find_table(g.name),
            "python benchmark/kernels/bench_grouped_gemm.py --tune (from a checkout)")),
        _guarded("FP8 MLA decode", fp8_mla_decode),
        _guarded("SBO cap", lambda: importlib.import_module("sglang_h20.moe.sbo").describe_cap(
            g.name, int(settings["sbo_max_per_expert"])) if g.capability[0] == 9 else "none: SBO is ours on SM90 only")]


def _guarded(label: str, describe) -> str:
    """One line of the doctor's table section: what `describe()` says, or why it cannot say (a kernel package that
    needs triton, no nvcc), so one missing piece never fails the whole report."""
    try:
        return f"  {label:<20}{describe()}"
    except Exception as e:
        return f"  {label:<20}unavailable ({type(e).__name__}: {e})"


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        prog="python -m sglang_h20 doctor", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__, epilog="exit status: 0 when the plugin is installed and every feature the switches "
                                    "(SGLANG_H20_* / --h20-*) ask for can turn on here; 1 otherwise.")
    ap.parse_args(argv)
    text, ok = report()
    print(text)
    return 0 if ok else 1
