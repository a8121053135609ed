"""The GPU calls that benchmark/results/README.md lists as ready parse against the current scripts, as
scripts/gpu_check.sh would pass them: a renamed flag, a dropped choice, a knob no step reads or a server flag
SGLang does not know fails here, on the CPU, instead of in a lent machine's minutes."""
from __future__ import annotations

import argparse
import re
import runpy
import shlex
import subprocess
import sys

import pytest

from repo_scripts import REPO

CALLS = re.findall(r"`(STEPS=\w[^`]*)`", (REPO / "benchmark" / "results" / "README.md").read_text())
GPU_CHECK = (REPO / "scripts" / "gpu_check.sh").read_text()
STEP_IF = re.compile(r'^if \[\[ " \$STEPS " == \*" (\w+) "\* \]\]', re.M)
ARITHMETIC = re.compile(r"\$\(\((?:[^()]|\([^()]*\))*\)\)")  # $(( $(left) - 40 )), a number at run time
EXPANSION = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")


def call_env(call: str) -> dict[str, str]:
    """`STEPS=ncu NCU_ARGS="--batch 1"` -> {"STEPS": "ncu", "NCU_ARGS": "--batch 1"}."""
    return dict(word.split("=", 1) for word in shlex.split(call))


# gpu_check.sh's `if [[ " $STEPS " == *" name "* ]] ... fi` blocks by step name, continuation lines joined
STEP_BLOCKS = {m.group(1): GPU_CHECK[m.start():GPU_CHECK.index("\nfi\n", m.start())].replace("\\\n", " ")
               for m in STEP_IF.finditer(GPU_CHECK)}
SERVER_ARGS = re.search(r'^SERVER_ARGS="([^"]*)"', GPU_CHECK, re.M).group(1)


def expand(text: str, env: dict[str, str]) -> str:
    """The shell's expansions in one command line: the call's variables (or their defaults), $OUT, $n (GPUs), the
    kernels loop's $name."""
    known = {"OUT": "/tmp/out", "n": "2", "name": "bench", "SERVER_ARGS": SERVER_ARGS, **env}
    text = ARITHMETIC.sub("100", text).replace('"${table_out[@]}"', "")
    return EXPANSION.sub(lambda m: known.get(m.group(1) or m.group(3), m.group(2) or ""), text)


def commands(step: str, env: dict[str, str]) -> list[tuple[str, list[str]]]:
    """(script, argv) of every `python3 <script>.py ...` or `python3 -m <module> ...` the step runs with this call's
    variables (a module as '-m <module>')."""
    out = []
    for line in STEP_BLOCKS[step].splitlines():
        m = re.search(r'python3 ("\$b"|-m \S+|\S+\.py)(.*)', line)
        if not m:
            continue
        args = expand(re.split(r" 2>&1| \| ", m.group(2))[0], env)
        scripts = [m.group(1)] if m.group(1) != '"$b"' else (  # the kernels loop: BENCHES, else every bench
            [f"benchmark/kernels/bench_{b}.py" for b in env["BENCHES"].split()] if "BENCHES" in env
            else sorted(str(p.relative_to(REPO)) for p in (REPO / "benchmark" / "kernels").glob("bench_*.py")))
        out += [(s, shlex.split(args)) for s in scripts]
    return out


class Parsed(Exception):
    pass


def parse_as_run(script: str, argv: list[str], monkeypatch) -> argparse.Namespace:
    """The script's own parser on argv, run as `python3 script argv` up to its first parse_args (required options
    waived: gpu_check.sh passes them); an unknown flag or a bad value exits with argparse's message instead."""
    plain = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        for action in self._actions:
            action.required = False
        raise Parsed(plain(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(Parsed) as parsed:
        if script.startswith("-m "):
            runpy.run_module(script[3:], run_name="__main__", alter_sys=True)
        else:
            monkeypatch.syspath_prepend(str(REPO / script.rsplit("/", 1)[0]))
            runpy.run_path(str(REPO / script), run_name="__main__")
    return parsed.value.args[0]


def test_the_readme_lists_calls():
    assert len(CALLS) >= 8, CALLS  # the pattern still finds the two tables' calls


@pytest.mark.parametrize("call", CALLS)
def test_every_knob_of_the_call_is_read_by_its_steps(call):
    env = call_env(call)
    steps = env["STEPS"].split()
    assert set(steps) <= set(STEP_BLOCKS), f"no such step in gpu_check.sh: {set(steps) - set(STEP_BLOCKS)}"
    unread = [k for k in env if k != "STEPS" and not any(f"${{{k}" in STEP_BLOCKS[s] for s in steps)]
    assert not unread, f"{unread}: no step of {steps} reads them"


@pytest.mark.parametrize("call", CALLS)
def test_the_call_parses_against_its_scripts(call, monkeypatch):
    env = call_env(call)
    runs = [run for step in env["STEPS"].split() for run in commands(step, env)]
    assert runs, f"{call}: its steps run no script"
    for script, argv in runs:
        with monkeypatch.context() as m:
            ns = parse_as_run(script, argv, m)
        if "--server-args" in argv:  # the server flags the script passes on: SGLang's own parser
            from sglang.srt.server_args import ServerArgs
            parser = argparse.ArgumentParser()
            ServerArgs.add_cli_args(parser)
            parser.parse_args(["--model-path", "/tmp/model", *shlex.split(argv[argv.index("--server-args") + 1])])
        assert ns is not None


def test_a_wrong_flag_fails_the_parse(monkeypatch):
    """The check can fail: a call with a flag the script does not have exits with argparse's error."""
    env = {"STEPS": "ncu", "NCU_ARGS": "--batch 1 --no-such-flag"}
    (script, argv), = commands("ncu", env)
    with pytest.raises(SystemExit):
        parse_as_run(script, argv, monkeypatch)


def test_a_module_step_parses_with_the_module_itself(monkeypatch):
    """`python3 -m sglang_h20 calibrate ...` (the calibrate step) is parsed by the package's own CLI: a good grid
    parses, a bad one exits with argparse's error."""
    (script, argv), = commands("calibrate", {"STEPS": "calibrate", "GRID": "full"})
    assert script == "-m sglang_h20" and argv[:4] == ["calibrate", "mha-mla", "--grid", "full"]
    with monkeypatch.context() as m:
        assert parse_as_run(script, argv, m).grid == "full"
    (script, argv), = commands("calibrate", {"STEPS": "calibrate", "GRID": "huge"})
    with pytest.raises(SystemExit):
        parse_as_run(script, argv, monkeypatch)


def gpu_check_into(out) -> subprocess.CompletedProcess:
    """gpu_check.sh into `out`, holding what the call itself writes first (check.log, card.txt), with no devkit."""
    (out / "check.log").write_text("")
    (out / "card.txt").write_text("NVIDIA H200\n")
    return subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(out), "DK": str(out / "no-devkit")})


@pytest.mark.parametrize("stale", ["swapab_e2e.json", "logs.tar.xz", "swapab_e2e/"])
def test_gpu_check_refuses_an_out_folder_with_an_earlier_calls_results(tmp_path, stale):
    """A warm host keeps /tmp: a second call into the same OUT would keep the first call's record (the copy skips a
    JSON already there) and bundle away the old logs archive with the new logs in it. The script stops first, before
    it unpacks anything."""
    (tmp_path / stale.rstrip("/")).mkdir() if stale.endswith("/") else (tmp_path / stale).write_text("{}")
    res = gpu_check_into(tmp_path)
    assert res.returncode == 2
    assert f"OUT={tmp_path} already holds an earlier call's results (./{stale}); give an empty folder" in res.stderr
    assert "unpack" not in res.stdout + res.stderr  # stopped before the devkit


def test_gpu_check_takes_an_out_folder_with_only_the_calls_own_log(tmp_path):
    """check.log and card.txt, which the call writes before the script starts, pass: it goes on to the devkit."""
    res = gpu_check_into(tmp_path)
    assert res.returncode == 2 and "already holds" not in res.stderr
    assert f"FAIL: unpack {tmp_path}/no-devkit/site.tar.xz" in res.stdout
