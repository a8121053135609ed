"""The plugin inside the real, installed SGLang 0.5.17: discovery, loading, flags, switches, guards.

Everything that touches SGLang's process-global state (load_plugins runs once per process, the
HookRegistry is global) runs in a fresh Python process.
"""
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import sglang_h20
from sglang_h20 import compat, plugin
from sglang_h20.features import FEATURES, decide
from sglang_h20.settings import SWITCHES, Settings

from repo_scripts import REPO

CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_H20_") and k != "SGLANG_PLUGINS"}


def run_py(code: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    """Run code as a script file (multiprocessing's spawn re-imports __main__, which `-c` lacks)."""
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "script.py")
        with open(script, "w") as f:
            f.write(textwrap.dedent(code))
        return subprocess.run([sys.executable, script], capture_output=True, text=True,
                              env={**CLEAN_ENV, **(env or {})}, timeout=timeout)


def test_entry_point_is_discovered_through_importlib_metadata():
    eps = [e for e in md.entry_points(group="sglang.srt.plugins") if e.name == "sglang_h20"]
    assert len(eps) == 1
    assert eps[0].value == "sglang_h20.plugin:load"
    assert eps[0].load() is plugin.load
    assert eps[0].dist.name == "sglang-h20"


def test_installed_sglang_is_the_tested_version():
    assert compat.check_sglang() == (True, "sglang 0.5.17")


def test_every_plugin_hook_target_resolves_against_installed_sglang():
    for in_launcher in (True, False):
        for hook in plugin.plugin_hooks(in_launcher):
            assert compat.check_target(hook.target) == (True, hook.target)


def test_check_target_reports_missing_targets():
    ok, why = compat.check_target("sglang.srt.server_args.ServerArgs.no_such_method")
    assert not ok and "no attribute 'no_such_method'" in why
    ok, why = compat.check_target("sglang.srt.no_such_module.f")
    assert not ok and "does not resolve" in why


def test_load_plugins_runs_our_plugin_in_a_spawned_process():
    """A spawned child is what SGLang's scheduler is: load_plugins() there activates features at once."""
    r = run_py("""
        import multiprocessing as mp, json

        def child(q):
            from sglang.srt.plugins import load_plugins
            from sglang.srt.plugins.hook_registry import HookRegistry
            load_plugins()
            from sglang_h20 import plugin
            q.put({"decisions": {k: [d.on, d.reason] for k, d in plugin._decisions.items()},
                   "patched": sorted(HookRegistry._patched)})

        if __name__ == "__main__":
            ctx = mp.get_context("spawn"); q = ctx.Queue()
            p = ctx.Process(target=child, args=(q,)); p.start(); out = q.get(timeout=120); p.join()
            print("RESULT" + json.dumps(out))
        """, env={"SGLANG_H20_SBO": "on"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("RESULT", 1)[1])
    assert set(out["decisions"]) == {f.name for f in FEATURES}
    assert out["decisions"]["sbo"][1].startswith("SGLANG_H20_SBO=on asked for it")
    assert out["decisions"]["fp8_mla"] == [False, "switched off (SGLANG_H20_FP8_MLA=off)"]
    for hook in plugin.plugin_hooks(in_launcher=False):
        assert hook.target in out["patched"]
    # one line per feature, plus the hooks line and the summary line
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("[sglang-h20 pid")]
    assert len(lines) == len(FEATURES) + 2, lines
    assert any("hooks applied: 2/2" in ln for ln in lines), lines


def test_plugin_is_skipped_when_sglang_plugins_names_others():
    r = run_py("""
        from sglang.srt.plugins import load_plugins
        load_plugins()
        from sglang.srt.plugins.hook_registry import HookRegistry
        print("PATCHED", sorted(HookRegistry._patched))
        """, env={"SGLANG_PLUGINS": "__none__"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "PATCHED []" in r.stdout
    assert "[sglang-h20" not in r.stderr


def test_flags_appear_in_launch_server_help():
    r = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True, text=True,
                       env=CLEAN_ENV, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "sglang-h20 (plugin)" in r.stdout
    for s in SWITCHES:
        assert s.flag in r.stdout and s.env in r.stdout


def test_each_flag_shows_what_it_takes():
    """--help's placeholder says the kind of value: on/off (optional), the choices, a path, a count, a fraction."""
    import argparse

    from sglang_h20.settings import add_cli_args

    ap = argparse.ArgumentParser(prog="launch_server")
    add_cli_args(ap)
    usage = " ".join(ap.format_usage().split())
    for shown in ("--h20-swapab [{on,off}]", "--h20-mha-mla-policy {upstream,se,mha,mla}", "--h20-observe FRACTION",
                  "--h20-eplb-affinity FRACTION", "--h20-sbo-shared-sms N", "--h20-dummy-router-clusters N",
                  "--h20-observe-control PATH", "--h20-fp8-mla-kernel-options MLA_OPTION[,...]"):
        assert shown in usage, shown


@pytest.mark.parametrize("argv, message", [
    (["--h20-fp8-mla", "maybe"], "argument --h20-fp8-mla: expected one of on/off/1/0/true/false, got 'maybe'"),
    (["--h20-mha-mla-policy", "fast"], "argument --h20-mha-mla-policy: expected one of upstream/se/mha/mla, got 'fast'"),
    (["--h20-observe", "2"], "argument --h20-observe: expected a number in [0, 1], got '2'"),
])
def test_bad_flag_values_are_rejected_with_a_clear_message(argv, message):
    r = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", "x", *argv],
                       capture_output=True, text=True, env=CLEAN_ENV, timeout=300)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_the_dummy_models_tokenizer_agrees_with_its_config(tmp_path):
    """The generated tokenizer puts the config's BOS id first, names the config's EOS id as its own, and allows the
    config's context: SGLang reads the ids from config.json / generation_config.json and the rest from the tokenizer."""
    from transformers import AutoTokenizer

    from sglang_h20 import models

    out = models.make(tmp_path, "dsv3-4l")
    cfg = json.loads((out / "config.json").read_text())
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (cfg["bos_token_id"], cfg["eos_token_id"])
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok("w5 w77").input_ids == [cfg["bos_token_id"], 5, 77]
    assert (tok.bos_token_id, tok.eos_token_id) == (cfg["bos_token_id"], cfg["eos_token_id"])
    assert tok.model_max_length == cfg["max_position_embeddings"] and len(tok) == cfg["vocab_size"]
    assert tok.decode([5, 77]) == "w5 w77"

    class Edge:  # an rng that draws the lowest or the highest word random_words may ask for
        def __init__(self, high):
            self.high = high

        def randint(self, a, b):
            return b if self.high else a

    for high in (False, True):
        ids = tok(models.random_words(Edge(high), 3)).input_ids[1:]
        assert len(ids) == 3 and len(set(ids)) == 1 and tok.unk_token_id not in ids
        assert ids[0] not in tok.all_special_ids and ids[0] == (cfg["vocab_size"] - 1 if high else 4)


def test_cli_flags_reach_a_spawned_child_process(tmp_path):
    """The launcher parses --h20-* flags, exports them, and a spawned process (like the scheduler) sees them."""
    model = tmp_path / "m"
    subprocess.run([sys.executable, "scripts/make_model.py", str(tmp_path), "--models", "dsv3-4l"], check=True,
                   cwd=os.path.join(os.path.dirname(__file__), "..", ".."), capture_output=True, timeout=300)
    model = tmp_path / "dsv3-4l"
    r = run_py(f"""
        import multiprocessing as mp, json, os

        def child(q):
            from sglang.srt.plugins import load_plugins
            load_plugins()
            from sglang_h20 import plugin
            q.put({{"env": {{k: v for k, v in os.environ.items() if k.startswith("SGLANG_H20_")}},
                   "sbo": plugin._decisions["sbo"].reason, "eplb": plugin._decisions["eplb"].reason}})

        if __name__ == "__main__":
            from sglang.srt.plugins import load_plugins
            load_plugins()
            from sglang.srt.server_args import prepare_server_args
            args = prepare_server_args(["--model-path", "{model}", "--device", "cpu", "--load-format", "dummy",
                                        "--h20-sbo", "--h20-eplb", "affinity", "--h20-observe", "0.05"])
            from sglang_h20 import plugin
            launcher = {{k: d.reason for k, d in plugin._decisions.items()}}
            ctx = mp.get_context("spawn"); q = ctx.Queue()
            p = ctx.Process(target=child, args=(q,)); p.start(); out = q.get(timeout=120); p.join()
            print("RESULT" + json.dumps({{"child": out, "launcher": launcher}}))
        """, env={"SGLANG_H20_EPLB": "off"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("RESULT", 1)[1])
    assert out["child"]["env"] == {"SGLANG_H20_SBO": "on", "SGLANG_H20_EPLB": "affinity", "SGLANG_H20_OBSERVE": "0.05"}
    assert out["child"]["sbo"].startswith("SGLANG_H20_SBO=on asked for it")
    assert out["child"]["eplb"].startswith("on (SGLANG_H20_EPLB=affinity;")  # the flag beat the env
    assert out["launcher"]["sbo"] == out["child"]["sbo"]


def test_bad_environment_value_falls_back_with_one_clear_reason():
    s = Settings.from_env({"SGLANG_H20_SWAPAB": "bogus", "SGLANG_H20_OBSERVE": "-1"})
    assert s["swapab"] is False and s["observe"] == 0.0
    d = decide(next(f for f in FEATURES if f.name == "swapab"), s)
    assert not d.on
    assert d.reason == ("bad value, upstream behaviour kept: SGLANG_H20_SWAPAB='bogus': "
                        "expected one of on/off/1/0/true/false, got 'bogus'")
    assert "SGLANG_H20_OBSERVE" in s.errors["observe"]


def test_guards_keep_features_off_without_a_hopper_gpu(monkeypatch):
    """A feature that is built and switched on still stays off on a machine without sm_90."""
    from sglang_h20 import features

    f = features.Feature("demo", "sbo", "sglang_h20.settings")  # any importable module; hooks() never reached
    monkeypatch.setattr(compat, "check_gpu", lambda: (False, "Tesla V100 (sm_70, 32 GiB) is older than sm_90 (Hopper)"))
    d = decide(f, Settings.from_env({"SGLANG_H20_SBO": "1"}))
    assert not d.on
    assert d.reason == ("SGLANG_H20_SBO=on asked for it, but Tesla V100 (sm_70, 32 GiB) is older than sm_90 "
                        "(Hopper): upstream behaviour kept")


def test_guards_refuse_an_untested_sglang_unless_allowed(monkeypatch):
    from sglang_h20 import features

    monkeypatch.setattr(compat, "version", lambda dist: "0.6.0" if dist == "sglang" else None)
    f = features.Feature("demo", "eplb", "sglang_h20.settings", needs_gpu=False)
    d = decide(f, Settings.from_env({"SGLANG_H20_EPLB": "affinity"}))
    assert not d.on and "sglang 0.6.0 is untested (tested: 0.5.17)" in d.reason
    hooks_called = []
    hook = features.Hook(plugin.POST_INIT, lambda *a, **k: None, "before")  # resolves; never registered here
    monkeypatch.setattr(features.Feature, "hooks", lambda self, s: hooks_called.append(1) or [hook])
    d = decide(f, Settings.from_env({"SGLANG_H20_EPLB": "affinity", "SGLANG_H20_ALLOW_UNTESTED": "1"}))
    assert d.on and hooks_called


def test_feature_with_no_hooks_here_stays_off(monkeypatch):
    """A switched-on feature that ends up hooking nothing is off (it used to read 'on (...; 0 hook(s))')."""
    from sglang_h20 import features

    monkeypatch.setattr(features.Feature, "hooks", lambda self, s: [])
    f = features.Feature("demo", "eplb", "sglang_h20.settings", needs_gpu=False)
    d = decide(f, Settings.from_env({"SGLANG_H20_EPLB": "affinity"}))
    assert not d.on and d.reason == ("SGLANG_H20_EPLB=affinity asked for it, but it has nothing to hook here: "
                                     "upstream behaviour kept")


def test_feature_with_an_unresolvable_hook_target_stays_off(monkeypatch):
    from sglang_h20 import features

    bad = features.Hook("sglang.srt.server_args.ServerArgs.gone_in_a_later_version", lambda *a: None)
    monkeypatch.setattr(features.Feature, "hooks", lambda self, s: [bad])
    f = features.Feature("demo", "eplb", "sglang_h20.settings", needs_gpu=False)
    d = decide(f, Settings.from_env({"SGLANG_H20_EPLB": "affinity"}))
    assert not d.on and "has no attribute 'gone_in_a_later_version'" in d.reason


def test_every_built_feature_hook_target_resolves(monkeypatch):
    """For each built feature, with its switch on, every hook target resolves in the installed sglang."""
    monkeypatch.setattr(compat, "gpu", lambda: compat.Gpu("NVIDIA H200", (9, 0), 140.0))  # tables are per GPU
    env = {"SGLANG_H20_MHA_MLA_POLICY": "se", "SGLANG_H20_FP8_MLA": "1", "SGLANG_H20_SWAPAB": "1",
           "SGLANG_H20_SBO": "1", "SGLANG_H20_EPLB": "affinity", "SGLANG_H20_OBSERVE": "0.01",
           "SGLANG_H20_EPLB_ASYNC": "1", "SGLANG_H20_EPLB_ASYNC_PEER": "on", "SGLANG_H20_DUMMY_ROUTER_CLUSTERS": "8"}
    s = Settings.from_env(env)
    built = [f for f in FEATURES if f.module is not None]
    assert {"mha_mla_policy", "eplb", "eplb_async", "observe"} <= {f.name for f in built}
    for f in built:
        hooks = f.hooks(s)
        assert hooks, f.name
        for hook in hooks:
            assert compat.check_target(hook.target) == (True, hook.target), f.name


def test_doctor_names_the_tables_and_kernel_of_this_gpu(monkeypatch, tmp_path):
    """The tuned tables in force (shipped, or this machine's re-tune) with the GPU and date they were measured on,
    the re-tune command, and the decode kernel; a GPU without a table gets the command that makes one."""
    from sglang_h20 import doctor

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no re-tune on this machine
    monkeypatch.delenv("SGLANG_H20_GEMM_TABLE", raising=False)
    monkeypatch.setattr(compat, "gpu", lambda: None)
    assert "no CUDA GPU visible" in doctor.tables_and_kernels()[1]
    monkeypatch.setattr(compat, "gpu", lambda: compat.Gpu("NVIDIA H200", (9, 0), 140.0))
    text = "\n".join(doctor.tables_and_kernels())
    assert "mha_mla_h200.json, measured on NVIDIA H200" in text and "calibrate mha-mla" in text
    shipped = json.loads((Path(sglang_h20.__file__).parent / "tables" / "grouped_gemm_h200.json").read_text())
    day = shipped["date"][:10]  # the table's latest run, whichever session made it
    assert f"grouped_gemm_h200.json, measured on NVIDIA H200 ({day})" in text and "--tune" in text
    assert "FP8 MLA decode" in text
    assert "SBO cap             our MoE path up to 8 tokens per expert (measured end to end on the H200)" in text
    monkeypatch.setattr(compat, "gpu", lambda: compat.Gpu("NVIDIA H100 80GB HBM3", (9, 0), 80.0))
    assert "up to 4 tokens per expert (measured end to end on the H100)" in "\n".join(doctor.tables_and_kernels())
    override = Settings.from_env({"SGLANG_H20_SBO_MAX_PER_EXPERT": "2"})
    assert "up to 2 tokens per expert (SGLANG_H20_SBO_MAX_PER_EXPERT=2)" in doctor.report(override)[0]
    monkeypatch.setattr(compat, "gpu", lambda: compat.Gpu("NVIDIA H20", (9, 0), 96.0))
    assert "up to 8 tokens per expert (the H200's, not measured on this GPU)" in "\n".join(doctor.tables_and_kernels())
    monkeypatch.setattr(compat, "gpu", lambda: compat.Gpu("NVIDIA B200", (10, 0), 180.0))
    text = "\n".join(doctor.tables_and_kernels())
    assert text.count("none for this GPU; make one here") == 2
    assert "SBO cap             none: SBO is ours on SM90 only" in text
    # a kernel package that cannot be imported (it needs triton) leaves both table lines saying why, not a traceback
    monkeypatch.setitem(sys.modules, "sgl_kernel_ext.gemm_table", None)
    text = "\n".join(doctor.tables_and_kernels())
    assert "MHA/MLA cost table  unavailable (ModuleNotFoundError" in text
    assert "grouped GEMM table  unavailable (ModuleNotFoundError" in text


def test_doctor_names_the_tested_version_beside_an_untested_one(monkeypatch):
    """A version other than the tested one gets "(tested: X)" beside it; the tested one and the untracked ones none."""
    from sglang_h20 import doctor

    versions = {"sglang": "0.5.18", "torch": compat.TESTED_TORCH, "triton": "3.6.0"}
    monkeypatch.setattr(compat, "version", lambda dist: versions.get(dist))
    text = doctor.report()[0]
    assert f"  sglang             0.5.18  (tested: {compat.TESTED_SGLANG})\n" in text
    assert f"  torch              {compat.TESTED_TORCH}\n" in text and "  triton             3.6.0\n" in text
    assert "  sglang-kernel      not installed\n" in text and text.count("(tested:") == 1


def test_doctor_lists_only_the_hook_targets_that_do_not_resolve(monkeypatch):
    """Against the installed SGLang every launcher hook resolves: no "plugin hook" line. One that does not (an
    SGLang whose function moved) gets its own line with the reason, and the doctor's verdict turns false."""
    from sglang_h20 import doctor

    text, ok = doctor.report(Settings.from_env({}))
    assert "plugin hook" not in text and ok, text
    moved = plugin.plugin_hooks(in_launcher=True)[0].target
    real = compat.check_target
    monkeypatch.setattr(compat, "check_target",
                        lambda t: (False, f"{t}: not found") if t == moved else real(t))
    text, ok = doctor.report(Settings.from_env({}))
    assert [l for l in text.splitlines() if "plugin hook" in l] == [f"  plugin hook        {moved}: not found"]
    assert not ok


def test_doctor_runs_on_a_cpu_machine():
    r = subprocess.run([sys.executable, "-m", "sglang_h20", "doctor"], capture_output=True, text=True,
                       env={**CLEAN_ENV, "SGLANG_H20_FP8_MLA": "yes"}, timeout=300)
    assert "sglang             0.5.17" in r.stdout
    assert "entry point        sglang_h20.plugin:load" in r.stdout
    assert re.search(r"\n  SGLANG_H20_FP8_MLA +on +--h20-fp8-mla\n", r.stdout), r.stdout
    # one column per field whatever the longest name, and a list switch shown as a person types it
    assert re.search(r"\n  SGLANG_H20_FP8_MLA_KERNEL_OPTIONS none +--h20-fp8-mla-kernel-options\n", r.stdout)
    # fp8_mla was asked for but cannot turn on here (not built yet, or no GPU): doctor says so and exits 1
    assert r.returncode == 1
    assert "fp8_mla          off  SGLANG_H20_FP8_MLA=on asked for it" in r.stdout
    r = subprocess.run([sys.executable, "-m", "sglang_h20", "doctor"], capture_output=True, text=True,
                       env=CLEAN_ENV, timeout=300)
    assert r.returncode == 0, r.stdout


def test_top_level_cli_lists_its_commands_and_refuses_unknown_ones(capsys):
    """`python -m sglang_h20`: help on stdout (exit 0); no command or an unknown one gets the usage on stderr and
    exit 2, the unknown one named; a known command runs its own module's main with the rest of the arguments."""
    from sglang_h20 import __main__ as cli

    assert cli.main(["--help"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("usage: python -m sglang_h20 COMMAND [ARGS]\n") and not err
    assert f"\n  doctor     {cli.COMMANDS['doctor'][1]}\n" in out and "\n  observe    " in out
    assert cli.main([]) == 2
    out, err = capsys.readouterr()
    assert not out and err.startswith("usage:") and "error" not in err
    assert cli.main(["calibrte", "--help"]) == 2
    out, err = capsys.readouterr()
    assert not out and err.endswith("error: unknown command 'calibrte' (choose from doctor, calibrate, eplb, "
                                    "nightly, observe)\n")
    with pytest.raises(SystemExit) as e:  # argparse's --help of the command itself, not the top-level usage
        cli.main(["nightly", "compare", "--help"])
    assert e.value.code == 0 and "usage: python -m sglang_h20.nightly compare" in capsys.readouterr().out


def test_a_device_run_whose_guard_sees_no_gpu_stops_instead_of_skipping(tmp_path):
    """gpu_check.sh sets SGLANG_H20_EXPECT_GPU=1: there a GPU the guard cannot see (here: none) must stop pytest with
    the reason, not turn every gpu test into a skip and exit 0; without the variable the same test is skipped."""
    (tmp_path / "test_one_gpu.py").write_text("import pytest\n\n\n@pytest.mark.gpu\ndef test_x():\n    assert True\n")
    (tmp_path / "conftest.py").write_text((REPO / "test" / "conftest.py").read_text())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), str(REPO / "sgl-kernel-ext")])}
    run = lambda extra: subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                                        str(tmp_path)], capture_output=True, text=True, timeout=300,
                                       env={**env, **extra}, cwd=tmp_path)
    expect = run({"SGLANG_H20_EXPECT_GPU": "1"})
    assert expect.returncode != 0 and "SGLANG_H20_EXPECT_GPU=1 but" in expect.stdout + expect.stderr, expect.stdout
    plain = run({})
    assert plain.returncode == 0 and "1 skipped" in plain.stdout, plain.stdout
