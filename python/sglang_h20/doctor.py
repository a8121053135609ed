"""`python -m sglang_h20 doctor`: versions, GPU, and which features would activate here, and why.

It asks the same functions the plugin asks (compat, features.decide), so its answer is the
plugin's answer for the current environment. Works on a CPU-only machine.
"""
from __future__ import annotations

import importlib.metadata as md
import platform

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
    for s in SWITCHES:
        lines.append(f"  {s.env:<30} {s.show(settings[s.name]):<10} {s.flag}")
    lines.append("features (what the plugin would do in a server process here):")
    for feature in FEATURES:
        d = decide(feature, settings)
        all_good &= d.on or not feature.wanted(settings) and feature.switch not in settings.errors
        lines.append(f"  {feature.name:<16} {'ON ' if d.on else 'off'}  {d.reason}")
    return "\n".join(lines), all_good


def main(argv: list[str] | None = None) -> int:
    text, ok = report()
    print(text)
    return 0 if ok else 1
