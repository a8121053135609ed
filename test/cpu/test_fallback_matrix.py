"""The fallback matrix: every feature x every guard keeps upstream behaviour, raises nothing, and says why in
exactly one line of the `sglang_h20` logger.

Each cell runs `plugin.activate()` against the real, installed SGLang 0.5.17 with only that feature switched on.
What is monkeypatched is the machine, never SGLang: the GPU probe (`compat.gpu`), the installed-version lookup
(`compat.version`), a kernel module made unimportable (`sys.modules[name] = None`, what a missing or broken build
looks like to `import`), a plugin hook-target constant renamed (what a later SGLang without that function looks
like), and `plugin._register` (recorded, so nothing is patched into SGLang in this test process; every fallback
cell must register nothing anyway). Per-call and per-launch guards (dtype, block shape, runner, KV dtype, model,
speculative decoding) are exercised through the hook functions themselves.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from types import SimpleNamespace

import pytest
import torch

from sglang_h20 import compat, plugin
from sglang_h20.features import FEATURES
from sglang_h20.settings import BY_NAME

NAMES = [f.name for f in FEATURES]
ON = {  # the one switch that asks for each feature
    "mha_mla_policy": {"SGLANG_H20_MHA_MLA_POLICY": "se"},
    "fp8_mla": {"SGLANG_H20_FP8_MLA": "on"},
    "swapab": {"SGLANG_H20_SWAPAB": "on"},
    "sbo": {"SGLANG_H20_SBO": "on"},
    "eplb": {"SGLANG_H20_EPLB": "affinity"},
    "eplb_async": {"SGLANG_H20_EPLB_ASYNC": "on"},
    "dummy_router": {"SGLANG_H20_DUMMY_ROUTER_CLUSTERS": "8"},
    "observe": {"SGLANG_H20_OBSERVE": "0.01"},
}
H200 = compat.Gpu("NVIDIA H200", (9, 0), 140.0)
H100 = compat.Gpu("NVIDIA H100 80GB HBM3", (9, 0), 80.0)  # Hopper, with both tables of its own (sessions 56, 57)
H800 = compat.Gpu("NVIDIA H800", (9, 0), 80.0)  # Hopper, no shipped table of ours
B200 = compat.Gpu("NVIDIA B200", (10, 0), 180.0)
A100 = compat.Gpu("NVIDIA A100-SXM4-80GB", (8, 0), 80.0)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture
def activate(monkeypatch):
    """activate(env, gpu=H200, sglang="0.5.17", missing=()) -> (decisions, lines, registered) in a clean plugin
    state, with the `sglang_h20` logger set up as the plugin sets it up (own handler, no propagation)."""
    log = logging.getLogger("sglang_h20")
    saved = (list(log.handlers), log.level, log.propagate)
    lines = _Lines()
    log.handlers[:] = [lines]
    log.setLevel(logging.INFO)  # setLevel, not the attribute: child loggers cache their enabled levels
    log.propagate = False
    real_version = compat.version
    compat.check_import.cache_clear()

    def run(env, gpu=H200, sglang="0.5.17", missing=()):
        monkeypatch.setattr(compat, "gpu", lambda: gpu)
        monkeypatch.setattr(compat, "version", lambda dist: sglang if dist == "sglang" else real_version(dist))
        for m in missing:
            monkeypatch.setitem(sys.modules, m, None)
        compat.check_import.cache_clear()
        monkeypatch.setattr(plugin, "_decisions", None)
        monkeypatch.setattr(plugin, "_registered", [])
        registered = []
        monkeypatch.setattr(plugin, "_register", lambda hooks: registered.extend(h.target for h in hooks))
        lines.records.clear()
        from sglang_h20.settings import Settings

        decisions = plugin.activate(Settings.from_env(env))
        return decisions, [r.getMessage() for r in lines.records], registered

    yield run
    log.handlers[:], _, log.propagate = saved
    log.setLevel(saved[1])
    compat.check_import.cache_clear()
    from sglang_h20.observe import stages

    stages.reset_state()  # observe's hooks() configures its sampler


def lines_of(name: str, lines: list[str]) -> list[str]:
    return [ln for ln in lines if ln.startswith(f"{name}:")]


def assert_one_fallback_line(name, decisions, lines, registered, *reason):
    assert not decisions[name].on, decisions[name]
    mine = lines_of(name, lines)
    assert len(mine) == 1, lines  # exactly one line for this feature ...
    for part in reason:  # ... naming the reason
        assert part in mine[0], (part, mine[0])
    assert "upstream behaviour kept" in mine[0]
    assert registered == []  # nothing of the plugin's reaches SGLang
    assert lines[-1].endswith("active: no features (upstream behaviour)"), lines[-1]
    for other in NAMES:  # every other feature: its own one line, switched off
        if other != name:
            assert len(lines_of(other, lines)) == 1 and not decisions[other].on


# ---- guards every feature goes through (features.decide) -------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_untested_sglang_version(activate, name):
    d, lines, reg = activate(ON[name], sglang="0.6.0")
    assert_one_fallback_line(name, d, lines, reg, "sglang 0.6.0 is untested (tested: 0.5.17)",
                             "SGLANG_H20_ALLOW_UNTESTED=1")


@pytest.mark.parametrize("name", [f.name for f in FEATURES if f.needs_gpu])
@pytest.mark.parametrize("gpu, why", [(None, "no CUDA GPU visible"), (A100, "is older than sm_90 (Hopper)")])
def test_no_cuda_or_a_gpu_older_than_sm90(activate, name, gpu, why):
    d, lines, reg = activate(ON[name], gpu=gpu)
    assert_one_fallback_line(name, d, lines, reg, why)


def test_gpu_reads_the_first_device_and_a_broken_driver_is_no_gpu(monkeypatch):
    """What every guard above stands on: compat.gpu() describes device 0 as the guards read it, and is None where
    CUDA is absent or the driver raises."""
    def fresh_gpu():  # compat.gpu() is cached per process
        compat.gpu.cache_clear()
        return compat.gpu()

    def broken(i):
        raise RuntimeError("CUDA driver version is insufficient")

    props = SimpleNamespace(name="NVIDIA H20", major=9, minor=0, total_memory=96 * 2**30)
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: seen.append(i) or props)
    try:
        g = fresh_gpu()
        assert (g.name, g.capability, g.memory_gib, seen) == ("NVIDIA H20", (9, 0), 96.0, [0])
        assert g.label == "NVIDIA H20 (sm_90, 96 GiB)"
        monkeypatch.setattr(torch.cuda, "get_device_properties", broken)
        assert fresh_gpu() is None
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
        assert fresh_gpu() is None
    finally:
        compat.gpu.cache_clear()


def test_eplb_features_need_no_gpu():
    """eplb and eplb_async run on the host (placement) and through SGLang's own weight movement: no GPU guard."""
    assert {f.name for f in FEATURES if not f.needs_gpu} == {"eplb", "eplb_async", "dummy_router"}


@pytest.mark.parametrize("name, module", [(f.name, m) for f in FEATURES for m in f.kernel_modules
                                          if m.startswith("sgl_kernel_ext")])
def test_missing_kernel_module(activate, name, module):
    d, lines, reg = activate(ON[name], missing=(module,))
    assert_one_fallback_line(name, d, lines, reg, f"{module} does not import (ModuleNotFoundError")


TARGET_CONSTANTS = {  # per feature: a hook target its hooks() names, as a module constant
    "mha_mla_policy": ("sglang_h20.attention.mha_mla", "TARGET"),
    "fp8_mla": ("sglang_h20.attention.fp8_mla_backend", "SELECT_TARGET"),
    "swapab": ("sglang_h20.moe.swapab", "TRITON_MOE"),
    "sbo": ("sglang_h20.moe.sbo", "INIT_MOE_CONFIG"),
    "eplb": ("sglang_h20.eplb.integration", "RECORD_TARGET"),
    "eplb_async": ("sglang_h20.eplb.async_rebalance", "INIT_TARGET"),
    "dummy_router": ("sglang_h20.eplb.dummy_router", "TARGET"),
    "observe": ("sglang_h20.observe.stages", "STEP_TARGET"),
}


@pytest.mark.parametrize("name", NAMES)
def test_hook_target_that_does_not_resolve(activate, monkeypatch, name):
    """As with a later SGLang that renamed one function: the feature stays off; nothing else of it (e.g. swapab's
    table line, sbo's cost warning) is said."""
    import importlib

    module, const = TARGET_CONSTANTS[name]
    mod = importlib.import_module(module)
    gone = getattr(mod, const) + "_gone_in_a_later_version"
    monkeypatch.setattr(mod, const, gone)
    d, lines, reg = activate(ON[name])
    assert_one_fallback_line(name, d, lines, reg, f"hook target {gone}", "has no attribute")


BAD_ENV = [  # (feature, env, the variable named in the line)
    ("mha_mla_policy", {"SGLANG_H20_MHA_MLA_POLICY": "fast"}, "SGLANG_H20_MHA_MLA_POLICY='fast'"),
    ("fp8_mla", {"SGLANG_H20_FP8_MLA": "maybe"}, "SGLANG_H20_FP8_MLA='maybe'"),
    ("fp8_mla", {"SGLANG_H20_FP8_MLA": "on", "SGLANG_H20_FP8_MLA_KERNEL": "fastest"},
     "SGLANG_H20_FP8_MLA_KERNEL='fastest'"),
    ("fp8_mla", {"SGLANG_H20_FP8_MLA": "on", "SGLANG_H20_FP8_MLA_SPLIT_Q": "both"},
     "SGLANG_H20_FP8_MLA_SPLIT_Q='both'"),
    ("fp8_mla", {"SGLANG_H20_FP8_MLA": "on", "SGLANG_H20_FP8_MLA_KERNEL_OPTIONS": "NOT_AN_OPTION"},
     "SGLANG_H20_FP8_MLA_KERNEL_OPTIONS='NOT_AN_OPTION'"),
    ("swapab", {"SGLANG_H20_SWAPAB": "bogus"}, "SGLANG_H20_SWAPAB='bogus'"),
    ("sbo", {"SGLANG_H20_SBO": "2"}, "SGLANG_H20_SBO='2'"),
    ("sbo", {"SGLANG_H20_SBO": "on", "SGLANG_H20_SBO_MAX_PER_EXPERT": "eight"},
     "SGLANG_H20_SBO_MAX_PER_EXPERT='eight'"),
    ("sbo", {"SGLANG_H20_SBO": "on", "SGLANG_H20_SBO_SHARED_SMS": "-3"}, "SGLANG_H20_SBO_SHARED_SMS='-3'"),
    ("eplb", {"SGLANG_H20_EPLB": "on"}, "SGLANG_H20_EPLB='on'"),
    ("eplb", {"SGLANG_H20_EPLB": "affinity", "SGLANG_H20_EPLB_AFFINITY": "2"}, "SGLANG_H20_EPLB_AFFINITY='2'"),
    ("eplb_async", {"SGLANG_H20_EPLB_ASYNC": "soon"}, "SGLANG_H20_EPLB_ASYNC='soon'"),
    ("eplb_async", {"SGLANG_H20_EPLB_ASYNC": "on", "SGLANG_H20_EPLB_ASYNC_LAUNCH": "now"},
     "SGLANG_H20_EPLB_ASYNC_LAUNCH='now'"),
    *[("eplb_async", {"SGLANG_H20_EPLB_ASYNC": "on", f"SGLANG_H20_EPLB_ASYNC_{o}": "maybe"},
       f"SGLANG_H20_EPLB_ASYNC_{o}='maybe'") for o in ("VERIFY", "SHUFFLE", "PEER")],
    ("dummy_router", {"SGLANG_H20_DUMMY_ROUTER_CLUSTERS": "-3"}, "SGLANG_H20_DUMMY_ROUTER_CLUSTERS='-3'"),
    ("observe", {"SGLANG_H20_OBSERVE": "-1"}, "SGLANG_H20_OBSERVE='-1'"),
    ("observe", {"SGLANG_H20_OBSERVE": "0.01x"}, "SGLANG_H20_OBSERVE='0.01x'"),
]


@pytest.mark.parametrize("name, env, named", BAD_ENV, ids=[f"{n}-{list(e)[-1]}" for n, e, _ in BAD_ENV])
def test_bad_environment_value(activate, name, env, named):
    """A bad value of a feature's switch, or of one of its other switches (which used to be dropped silently:
    SGLANG_H20_EPLB_AFFINITY=2 ran affinity placement at 0.25 without a word), keeps it off with one line."""
    d, lines, reg = activate(env)
    assert_one_fallback_line(name, d, lines, reg, "bad value", named)


def test_every_switch_belongs_to_a_feature():
    """A switch no feature owns would have its bad value dropped silently (its default used without a word); only
    SGLANG_H20_ALLOW_UNTESTED is everyone's (the test below). Each environment variable has a BAD_ENV row."""
    from sglang_h20.features import FEATURES
    from sglang_h20.settings import SWITCHES

    owned = [n for f in FEATURES for n in (f.switch, *f.options)]
    assert len(owned) == len(set(owned))
    assert {s.name for s in SWITCHES} - set(owned) == {"allow_untested"}
    in_bad_env = {var for _, env, named in BAD_ENV for var in env if named.startswith(var + "=")}
    assert {s.env for s in SWITCHES if _kind(s)} - in_bad_env == {"SGLANG_H20_ALLOW_UNTESTED"}


@pytest.mark.parametrize("name", NAMES)
def test_bad_allow_untested_value_keeps_an_asked_for_feature_off(activate, name):
    d, lines, reg = activate({**ON[name], "SGLANG_H20_ALLOW_UNTESTED": "maybe"})
    assert_one_fallback_line(name, d, lines, reg, "bad value", "SGLANG_H20_ALLOW_UNTESTED='maybe'")


# ---- guards of one feature, on a GPU that passes the common ones --------------------------------------------------

def test_sbo_on_a_gpu_that_is_not_sm90(activate):
    """Was: 'sbo: ... is not SM90' from the module, then 'sbo: on (SGLANG_H20_SBO=on; 0 hook(s))' and sbo in the
    active list: two lines and a wrong answer."""
    d, lines, reg = activate(ON["sbo"], gpu=B200)
    assert_one_fallback_line("sbo", d, lines, reg, "NVIDIA B200 (sm_100, 180 GiB) is not SM90")
    assert not any("hides 12-30% of the combine" in ln for ln in lines)


@pytest.mark.parametrize("gpu", [H800, compat.Gpu("NVIDIA H20", (9, 0), 96.0), B200])
def test_swapab_on_a_gpu_without_a_table(activate, gpu):
    """Was: the module's 'no grouped-GEMM table' line, then 'swapab: on (...; 0 hook(s))' (so on an H20, too)."""
    d, lines, reg = activate(ON["swapab"], gpu=gpu)
    assert_one_fallback_line("swapab", d, lines, reg, f"no grouped-GEMM table for {gpu.name}", "--tune")


def test_swapab_on_an_h100_reads_its_own_table(activate):
    """Since session 56 the H100 has a measured table: swapAB turns on there and names it (not the H200's)."""
    d, lines, reg = activate(ON["swapab"], gpu=H100)
    sw = lines_of("swapab", lines)
    assert d["swapab"].on and len(sw) == 2 and "grouped_gemm_h100.json" in sw[1] and "h200" not in sw[1]


def test_mha_mla_se_policy_on_a_gpu_without_a_table(activate):
    d, lines, reg = activate(ON["mha_mla_policy"], gpu=H800)
    assert not d["mha_mla_policy"].on
    (line,) = lines_of("mha_mla_policy", lines)
    assert "no MHA/MLA cost table for 'NVIDIA H800'" in line and "calibrate mha-mla" in line
    assert reg == [] and lines[-1].endswith("no features (upstream behaviour)")
    # the forced policies need no table: they turn on
    d, lines, reg = activate({"SGLANG_H20_MHA_MLA_POLICY": "mla"}, gpu=H800)
    assert d["mha_mla_policy"].on and len(lines_of("mha_mla_policy", lines)) == 1


def test_mha_mla_se_policy_on_an_h100_reads_its_own_table(activate):
    """Since session 57 the H100 has a measured cost table: the 'se' policy turns on there and names it."""
    d, lines, reg = activate(ON["mha_mla_policy"], gpu=H100)
    assert d["mha_mla_policy"].on
    text = " ".join(lines_of("mha_mla_policy", lines))
    assert "mha_mla_h100.json" in text and "measured on NVIDIA H100 80GB HBM3" in text and "h200" not in text
    # the H20's shipped table is modelled, and its line says so; a forced policy reads no table and names none
    d, lines, reg = activate(ON["mha_mla_policy"], gpu=compat.Gpu("NVIDIA H20", (9, 0), 96.0))
    (table_line,) = [ln for ln in lines_of("mha_mla_policy", lines) if "table" in ln]
    assert d["mha_mla_policy"].on and "mha_mla_h20.json (modelled" in table_line
    d, lines, reg = activate({"SGLANG_H20_MHA_MLA_POLICY": "mla"}, gpu=H100)
    assert d["mha_mla_policy"].on and not any("table" in ln for ln in lines_of("mha_mla_policy", lines))


def test_notes_of_a_feature_come_only_once_it_is_on(activate):
    """swapab's table and sbo's cost warning follow the feature's own line, and only when it is on."""
    d, lines, reg = activate({**ON["swapab"], **ON["sbo"]})
    assert d["swapab"].on and d["sbo"].on and reg  # recorded, not registered with SGLang
    sw, sb = lines_of("swapab", lines), lines_of("sbo", lines)
    assert len(sw) == 2 and sw[0].startswith("swapab: on (") and "grouped_gemm_h200.json" in sw[1]
    assert len(sb) == 2 and sb[0].startswith("sbo: on (") and "hides 12-30% of the combine" in sb[1]


# ---- bad flag values: argparse refuses them, in one line --------------------------------------------------------

BAD_FLAGS = {"bool": "maybe", "choice": "bogus", "fraction": "1.5", "int": "-3", "options": "NOT_AN_OPTION"}


def _kind(switch) -> str | None:
    from sglang_h20 import settings

    if switch.parse is settings._parse_bool:
        return "bool"
    if getattr(switch.parse, "choices", None):
        return "choice"
    if switch.parse is settings._fraction:
        return "fraction"
    if switch.parse is settings._non_negative_int:
        return "int"
    if switch.parse is settings._design_options:
        return "options"
    return None  # a path: any text


def test_every_flag_but_the_paths_has_a_bad_value_test():
    """A new kind of switch gets its bad value in BAD_FLAGS, not a silent pass as 'a path'."""
    from sglang_h20 import settings

    assert {s.name for s in BY_NAME.values() if _kind(s) is None} == {
        s.name for s in BY_NAME.values() if s.parse is settings._path}


@pytest.mark.parametrize("switch", [s for s in BY_NAME.values() if _kind(s)], ids=lambda s: s.flag)
def test_bad_flag_value_is_an_argparse_error(switch, capsys):
    """Every --h20-* flag with a closed set of values, on SGLang's own parser with the plugin's flags added as its
    add_cli_args hook adds them (test_plugin runs three of these through launch_server)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    plugin._add_flags(None, parser)
    bad = BAD_FLAGS[_kind(switch)]
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--model-path", "m", switch.flag, bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {switch.flag}: expected " in err and repr(bad) in err and "Traceback" not in err
    ns = parser.parse_args(["--model-path", "m", switch.flag, switch.default or "0"])
    assert getattr(ns, switch.dest) == (switch.default or "0")


# ---- per-call and per-launch guards ------------------------------------------------------------------------------

@pytest.fixture
def plugin_lines():
    """The records of the `sglang_h20` logger tree, whatever the logger's state in this process."""
    log = logging.getLogger("sglang_h20")
    saved = (list(log.handlers), log.level, log.propagate)
    h = _Lines()
    log.handlers[:] = [h]
    log.setLevel(logging.INFO)
    log.propagate = False
    yield h.records
    log.handlers[:], _, log.propagate = saved
    log.setLevel(saved[1])


def _moe_call(hook, **kw):
    calls = []
    cfg = SimpleNamespace(activation="silu", is_gated=True, gemm1_alpha=None, gemm1_clamp_limit=None,
                          no_combine=False, apply_router_weight_on_input=False, inplace=False,
                          routed_scaling_factor=None)
    x = torch.zeros(2, 128, dtype=torch.bfloat16)
    ids = torch.zeros(2, 2, dtype=torch.int32)
    topk = (torch.ones(2, 2), ids, None)
    w = torch.zeros(4, 256, 128)
    out = hook(lambda *a, **k: calls.append((a, k)) or "upstream", x, w, w, topk, cfg, **kw)
    assert out == "upstream" and len(calls) == 1 and calls[0][0][0] is x
    for k, v in kw.items():
        assert calls[0][1][k] is v
    return calls


@pytest.mark.parametrize("kw, why", [
    (dict(use_fp8_w8a8=False), "not FP8 w8a8"),
    (dict(use_fp8_w8a8=True, block_shape=[64, 64]), "block shape [64, 64] (ours: [128, 128])"),
    (dict(use_fp8_w8a8=True, block_shape=None), "block shape None"),
])
def test_sbo_declines_other_moe_weights_with_one_line(plugin_lines, kw, why):
    """sbo's triton MoE hook: non-FP8 weights or non-128 blocks go upstream unchanged, the reason said once
    however often it is called (swapab's own hook: test_swapab_integration)."""
    from sglang_h20.moe import sbo

    sbo._note.clear()
    for _ in range(3):
        _moe_call(sbo.fused_experts_hook, **kw)
    lines = [r.getMessage() for r in plugin_lines]
    assert len(lines) == 1 and lines[0].startswith("sbo: upstream for ") and why in lines[0], lines
    sbo._note.clear()


@pytest.mark.parametrize("runner, a2a, noted", [
    ("triton", "none", False), ("auto", "none", False), (None, None, False),
    ("deep_gemm", "none", True), ("flashinfer_cutlass", "none", True), ("auto", "deepep", True),
])
def test_sbo_says_once_when_the_moe_never_reaches_the_triton_runner(plugin_lines, monkeypatch, runner, a2a, noted):
    """Without the triton MoE runner, sbo's down-GEMM combine never runs; that used to go unsaid (the feature's
    line says 'on'). SGLang's initialize_moe_config (hooked) sees the server's MoE backends in every scheduler."""
    from sglang_h20.moe import sbo

    sbo._note.clear()
    monkeypatch.setattr(compat, "gpu", lambda: B200)  # not SM90: upstream's initialize_moe_config as called
    seen = []
    args = SimpleNamespace(moe_runner_backend=runner, moe_a2a_backend=a2a, enable_single_batch_overlap=False)
    for _ in range(2):
        sbo.init_moe_config_hook(seen.append, args)
    assert seen == [args, args]
    lines = [r.getMessage() for r in plugin_lines]
    if noted:
        assert len(lines) == 1 and f"MoE runner {runner} with all-to-all {a2a}" in lines[0], lines
        assert "triton runner" in lines[0]
    else:
        assert lines == []
    sbo._note.clear()


def _launch(model=None, **kw):
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig

    cfg = dict(attention_arch=AttentionArch.MLA, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
               hf_config=SimpleNamespace(architectures=["DeepseekV3ForCausalLM"]), context_len=512)
    cfg.update(model or {})
    args = dict(attention_backend="flashmla", prefill_attention_backend=None, decode_attention_backend=None,
                kv_cache_dtype="auto", speculative_algorithm=None, page_size=None, dcp_size=1,
                disaggregation_mode="null", enable_hierarchical_cache=False, cuda_graph_config=CudaGraphConfig(),
                _cuda_graph_config_locked=set())
    args.update(kw)
    return SimpleNamespace(get_model_config=lambda: SimpleNamespace(**cfg), **args)


@pytest.mark.parametrize("kw, model, why", [
    (dict(kv_cache_dtype="fp8_e5m2"), None, "--kv-cache-dtype fp8_e5m2 was asked for"),
    (dict(kv_cache_dtype="bf16"), None, "--kv-cache-dtype bf16 was asked for"),
    (dict(speculative_algorithm="NEXTN"), None, "speculative decoding (NEXTN) is not supported"),
    (dict(speculative_algorithm="EAGLE"), None, "speculative decoding (EAGLE) is not supported"),
    ({}, dict(hf_config=SimpleNamespace(architectures=["Qwen3MoeForCausalLM"]), attention_arch=None),
     "does not use MLA"),
    ({}, dict(hf_config=SimpleNamespace(architectures=["MiniCPM3ForCausalLM"])), "is not DeepSeek-V2/V3"),
    ({}, dict(dtype=torch.float32), "the model dtype is torch.float32"),
])
def test_fp8_mla_unsupported_launch_keeps_the_backend_with_one_line(plugin_lines, kw, model, why):
    """SGLANG_H20_FP8_MLA=on with a launch it cannot serve: the hooked backend selection (what SGLang runs before
    its own) declares nothing, the user's backend stays, one line (an explicit --attention-backend h20_fp8_mla with
    speculative decoding is an argument error instead: test_fp8_mla_backend)."""
    from sglang.srt.configs.model_config import AttentionArch

    from sglang_h20.attention import fp8_mla_backend as fb

    if model and "attention_arch" in model:
        model["attention_arch"] = AttentionArch.MHA
    sa = _launch(model, **kw)
    fb.select_backend(sa)
    assert sa.attention_backend == "flashmla" and sa.kv_cache_dtype == kw.get("kv_cache_dtype", "auto")
    lines = [r.getMessage() for r in plugin_lines]
    assert len(lines) == 1 and why in lines[0] and lines[0].endswith("flashmla attention backend (upstream behaviour)")


def test_fp8_mla_decode_kernel_without_nvcc_is_the_triton_one_with_one_line(plugin_lines, monkeypatch):
    """The CUDA decode kernel needs sm_90 and nvcc; where it does not build, the backend runs the Triton kernel and
    says why once, when it is made (the reason's wording: test_fp8_mla_backend)."""
    import importlib

    from sglang_h20.attention import fp8_mla_backend as fb

    cu = importlib.import_module("sgl_kernel_ext.mla_decode_cuda")
    mla = importlib.import_module("sgl_kernel_ext.mla_decode")
    runner = SimpleNamespace(model_config=SimpleNamespace(num_attention_heads=16, context_len=512), device="cpu",
                             req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(2, 512, dtype=torch.int32)),
                             token_to_kv_pool=SimpleNamespace(page_size=64))
    for probe, why in ((None, "no CUDA device" if not torch.cuda.is_available() else None),
                       (lambda version=1, defines=(): (False, "build/load failed: nvcc not found"), "nvcc not found")):
        if probe is not None:
            monkeypatch.setattr(cu, "available", probe)
        elif why is None:
            continue
        plugin_lines.clear()
        be = fb.FP8MLABackend(runner, prefill_backend=None, num_heads=16)
        assert be._decode_fp8 is mla.mla_decode_fp8
        lines = [r.getMessage() for r in plugin_lines]
        assert len(lines) == 1 and "decode kernel Triton (CUDA kernel unavailable:" in lines[0] and why in lines[0]


def test_mha_mla_control_file_naming_a_policy_without_a_table_keeps_serving(plugin_lines, monkeypatch, tmp_path):
    """Was: FileNotFoundError out of the prefill dispatch (the scheduler died) when the control file said 'se' on
    a GPU without a cost table. Now the policy in force stays, with one line for that version of the file."""
    from sglang_h20.attention import mha_mla
    from sglang_h20.attention.mha_mla import BatchShape
    from sglang_h20.controlfile import write_control
    from sglang_h20.settings import Settings

    monkeypatch.setattr(compat, "gpu", lambda: H800)
    ctl = tmp_path / "policy"
    hook, _ = mha_mla.hooks(Settings.from_env({"SGLANG_H20_MHA_MLA_POLICY": "mha",
                                               "SGLANG_H20_MHA_MLA_CONTROL": str(ctl)}))
    shape = BatchShape([1024], [1024])
    assert hook.fn.policy.choose(shape) == "mha"
    write_control(ctl, "se")
    for _ in range(3):
        assert hook.fn.policy.choose(shape) == "mha"  # no exception; the forced policy stays
    lines = [r.getMessage() for r in plugin_lines]
    assert len(lines) == 1 and "says 'se', but FileNotFoundError" in lines[0] and "keeping 'mha'" in lines[0]
    write_control(ctl, "mla")
    os.utime(ctl, ns=(10**18, 10**18))  # a new version even within the clock's resolution
    assert hook.fn.policy.choose(shape) == "mla"  # a later good word still switches


def test_the_edges_of_a_closed_range_are_accepted():
    """Fractions take both ends (observe 1 = every decode pass; affinity 0 = balance only), counts take 0; just
    past an end, or not a number, is refused."""
    from sglang_h20 import settings

    assert [settings._fraction(t) for t in ("0", "1", "0.25")] == [0.0, 1.0, 0.25]
    for text in ("1.0001", "-0.0001", "nan", "x"):
        with pytest.raises(settings.SettingError, match=r"\[0, 1\]"):
            settings._fraction(text)
    assert settings._non_negative_int("0") == 0
    with pytest.raises(settings.SettingError):
        settings._non_negative_int("-1")
    s = settings.Settings.from_env({"SGLANG_H20_OBSERVE": "1", "SGLANG_H20_EPLB_AFFINITY": "0"})
    assert s["observe"] == 1.0 and s["eplb_affinity"] == 0.0
