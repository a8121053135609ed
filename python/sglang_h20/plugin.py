"""The SGLang plugin entry point: settings -> guards -> each enabled feature registers its hooks.

`load()` runs in every process that calls `sglang.srt.plugins.load_plugins()`:
- in the launching process it adds the --h20-* flags to SGLang's parser and exports the given
  flags to the environment before ServerArgs exists, and defers feature activation to
  `ServerArgs.__post_init__` (so flags count there too);
- in spawned processes (schedulers), the environment already holds every switch, so features
  activate at once, before SGLang applies the registered hooks.
Each feature logs exactly one line per process: on or off, and why.
"""
from __future__ import annotations

import logging
import multiprocessing
import sys

from sglang_h20 import __version__, settings as settings_mod
from sglang_h20.features import FEATURES, Decision, Hook, decide
from sglang_h20.settings import Settings

ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"
POST_INIT = "sglang.srt.server_args.ServerArgs.__post_init__"

log = logging.getLogger("sglang_h20")
_decisions: dict[str, Decision] | None = None  # set once per process by activate()
_registered: list[str] = []  # every target this process registered, for the "hooks applied" line


def _setup_logging() -> None:
    """Our own handler: SGLang configures logging late in spawned processes, and these lines must show."""
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("[sglang-h20 pid %(process)d] %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False


def _add_flags(_result, parser):
    settings_mod.add_cli_args(parser)
    from sglang_h20.attention import fp8_mla_backend

    fp8_mla_backend.add_backend_choice()  # --attention-backend h20_fp8_mla must parse before features activate


def _export_flags(_cls, namespace):
    settings_mod.export_cli_args(namespace)


def _activate_before_post_init(server_args, *_args, **_kwargs):
    from sglang_h20.attention import fp8_mla_backend

    fp8_mla_backend.request_from(server_args)  # naming the backend switches its feature on
    decisions = activate()
    fp8_mla_backend.fallback_if_off(server_args, decisions["fp8_mla"])  # ... or, if it stays off, drops the name


def plugin_hooks(in_launcher: bool) -> list[Hook]:
    """The hooks the plugin itself needs, whatever features are on."""
    hooks = [Hook(ADD_CLI_ARGS, _add_flags, "after"), Hook(FROM_CLI_ARGS, _export_flags, "before")]
    if in_launcher:
        hooks.append(Hook(POST_INIT, _activate_before_post_init, "before"))
    return hooks


def _register(hooks) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for h in hooks:
        HookRegistry.register(h.target, h.fn, HookType(h.kind))
        _registered.append(h.target)


def load() -> None:
    """Entry point of group `sglang.srt.plugins` (called by SGLang's load_plugins())."""
    _setup_logging()
    in_launcher = multiprocessing.parent_process() is None
    _register(plugin_hooks(in_launcher))
    if not in_launcher:
        activate()


def activate(settings: Settings | None = None) -> dict[str, Decision]:
    """Decide every feature once in this process, log one line each, register and apply hooks."""
    global _decisions
    if _decisions is not None:
        return _decisions
    _setup_logging()
    settings = Settings.from_env() if settings is None else settings
    _decisions = {}
    for feature in FEATURES:
        d = decide(feature, settings)
        _decisions[feature.name] = d
        log.info("%s: %s", feature.name, d.reason)
        if d.on:
            try:
                feature.enabled(settings)  # what only matters now that it is on (e.g. swapab's table)
            except Exception as e:  # a note must not take the server down
                log.warning("%s: %s while describing it (%s)", feature.name, type(e).__name__, e)
        _register(d.hooks)
    from sglang.srt.plugins.hook_registry import HookRegistry

    HookRegistry.apply_hooks()  # idempotent; needed when we activate after load_plugins() applied
    applied = [t for t in _registered if t in HookRegistry._patched]
    log.info("hooks applied: %d/%d (%s)", len(applied), len(_registered), ", ".join(_registered))
    log.info("sglang-h20 %s active: %s", __version__,
             ", ".join(n for n, d in _decisions.items() if d.on) or "no features (upstream behaviour)")
    return _decisions
