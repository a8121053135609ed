"""The features, what each needs, and the one place that decides whether it turns on.

A feature module exposes `hooks(settings) -> list[Hook]`: its whole patch surface as dotted
SGLang targets, so reading those functions shows everything we change in SGLang. Where the feature
cannot apply on this machine (no table for this GPU, not SM90, ...), `hooks()` raises `Unsupported`
with the reason, which becomes the feature's one log line; it logs nothing itself. An optional
`enabled(settings)` says what only matters once the feature is on (the plugin calls it then).
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, NamedTuple

from sglang_h20 import compat
from sglang_h20.settings import BY_NAME, Settings


class Unsupported(Exception):
    """Raised by a feature's hooks(): it cannot apply here (the message says why); upstream behaviour is kept."""


class Hook(NamedTuple):
    target: str  # dotted path resolved by sglang.srt.plugins.hook_registry.HookRegistry
    fn: Callable
    kind: str = "around"  # before / after / around / replace (HookType values)


@dataclasses.dataclass(frozen=True)
class Feature:
    name: str
    switch: str  # key in settings.SWITCHES
    module: str | None  # provides hooks(settings); None while the feature is not built yet
    needs_gpu: bool = True  # Hopper (sm_90) or newer
    kernel_modules: tuple[str, ...] = ()  # must import, or the feature stays off
    options: tuple[str, ...] = ()  # its other switches: a bad value there keeps the feature off too
    needs: str = ""  # the server flags its hooks need; elsewhere it is on but routed around (one line at startup)

    def wanted(self, settings: Settings) -> bool:
        value = settings[self.switch]
        return value not in (False, 0, 0.0, "off", "upstream")

    def hooks(self, settings: Settings) -> list[Hook]:
        return importlib.import_module(self.module).hooks(settings)

    def enabled(self, settings: Settings) -> None:
        """Once the feature is on: its module's notes that only matter then (e.g. the table in force)."""
        note = getattr(importlib.import_module(self.module), "enabled", None)
        if note is not None:
            note(settings)


FEATURES: tuple[Feature, ...] = (
    Feature("mha_mla_policy", "mha_mla_policy", "sglang_h20.attention.mha_mla", options=("mha_mla_control",),
            needs="a prefill attention backend with SGLang's shared MHA/MLA rule: fa3, flashinfer, flashmla, "
                  "cutlass_mla, fa4, intel_xpu or h20_fp8_mla (not triton, trtllm_mla, aiter, dsa, ...)"),
    Feature("fp8_mla", "fp8_mla", "sglang_h20.attention.fp8_mla_backend", kernel_modules=("sgl_kernel_ext.mla_decode",),
            options=("fp8_mla_kernel", "fp8_mla_split_q", "fp8_mla_kernel_options")),
    Feature("swapab", "swapab", "sglang_h20.moe.swapab", kernel_modules=("triton", "sgl_kernel_ext.grouped_gemm_fp8"),
            needs="MoE: --moe-runner-backend triton (auto picks it without an all-to-all backend), or DeepGEMM's "
                  "masked GEMM under --moe-a2a-backend deepep; dense linears: --fp8-gemm-backend triton or deep_gemm "
                  "(auto picks one of them on Hopper)"),
    Feature("sbo", "sbo", "sglang_h20.moe.sbo", kernel_modules=("triton", "sgl_kernel_ext.sbo"),
            options=("sbo_max_per_expert", "sbo_shared_sms"),
            needs="the combine in the down GEMM: --moe-runner-backend triton (auto picks it without an all-to-all "
                  "backend)"),
    Feature("eplb", "eplb", "sglang_h20.eplb.integration", needs_gpu=False, options=("eplb_affinity",),
            needs="--enable-eplb (the placement runs in SGLang's rebalances)"),
    Feature("eplb_async", "eplb_async", "sglang_h20.eplb.async_rebalance", needs_gpu=False,
            options=("eplb_async_launch", "eplb_async_verify", "eplb_async_shuffle", "eplb_async_peer"),
            needs="--enable-eplb (it runs SGLang's rebalances)"),
    Feature("dummy_router", "dummy_router_clusters", "sglang_h20.eplb.dummy_router", needs_gpu=False),
    Feature("observe", "observe", "sglang_h20.observe.stages", options=("observe_control",)),
)


class Decision(NamedTuple):
    on: bool
    reason: str
    hooks: tuple[Hook, ...] = ()


def decide(feature: Feature, settings: Settings) -> Decision:
    """On only if switched on, built, supported here, and every hook target resolves."""
    switch = BY_NAME[feature.switch]
    bad = [settings.errors[n] for n in (feature.switch, *feature.options) if n in settings.errors]
    if bad:
        return Decision(False, f"bad value, upstream behaviour kept: {'; '.join(bad)}")
    shown = f"{switch.env}={switch.show(settings[feature.switch])}"
    if not feature.wanted(settings):
        return Decision(False, f"switched off ({shown})")
    if "allow_untested" in settings.errors:  # every feature's switch: unreadable means none may turn on
        return Decision(False, f"{shown} asked for it, but bad value, upstream behaviour kept: "
                               f"{settings.errors['allow_untested']}")
    if feature.module is None:
        return Decision(False, f"{shown} asked for it, but this build does not include it yet: upstream behaviour kept")
    checks = []
    if not settings["allow_untested"]:
        checks.append(compat.check_sglang())
    if feature.needs_gpu:
        checks.append(compat.check_gpu())
    checks += [compat.check_import(m) for m in feature.kernel_modules]
    for ok, why in checks:
        if not ok:
            return Decision(False, f"{shown} asked for it, but {why}: upstream behaviour kept")
    try:
        hooks = tuple(feature.hooks(settings))
    except Unsupported as e:
        return Decision(False, f"{shown} asked for it, but {e}: upstream behaviour kept")
    except Exception as e:
        return Decision(False, f"{shown} asked for it, but its hooks failed to build ({type(e).__name__}: {e})")
    if not hooks:
        return Decision(False, f"{shown} asked for it, but it has nothing to hook here: upstream behaviour kept")
    for hook in hooks:
        ok, why = compat.check_target(hook.target)
        if not ok:
            return Decision(False, f"{shown} asked for it, but {why}: upstream behaviour kept")
    return Decision(True, f"on ({shown}; {len(hooks)} hook(s))", hooks)
