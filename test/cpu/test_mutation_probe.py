"""scripts/mutation_probe.py: a mutation the tests miss is reported, one they catch is not, the module is restored."""
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

PROBE = Path(__file__).resolve().parents[2] / "scripts" / "mutation_probe.py"
MODULE = "def add_tax(x):\n    return x + 2\n\n\ndef negate(flag):\n    return not flag\n"


@pytest.mark.parametrize("tests,survivors", [
    ("def test_it():\n    assert add_tax(1) == 3 and negate(True) is False\n", 0),
    ("def test_it():\n    assert add_tax(1) is not None and negate(True) is not None\n", 3),
])
def test_probe_reports_the_mutations_the_tests_miss(tmp_path, tests, survivors):
    (tmp_path / "taxes.py").write_text(MODULE)
    (tmp_path / "test_taxes.py").write_text("from taxes import add_tax, negate\n\n\n" + tests)
    r = subprocess.run([sys.executable, str(PROBE), "taxes.py", "--mutants", "10", "--", "test_taxes.py"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert f"{survivors} of 3 mutations survived" in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("SURVIVED") == survivors and r.returncode == (1 if survivors else 0)
    assert (tmp_path / "taxes.py").read_text() == MODULE


def test_probe_refuses_what_is_not_a_python_file(tmp_path):
    r = subprocess.run([sys.executable, str(PROBE), str(tmp_path / "none.txt"), "--", "x"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "not a Python file" in r.stderr


def test_a_killed_probe_restores_the_module(tmp_path):
    """SIGTERM mid-run (the way to stop a probe started with `&`, which ignores SIGINT): the test run is stopped,
    the module is the original again, and the exit status says it was terminated."""
    (tmp_path / "taxes.py").write_text(MODULE)
    (tmp_path / "test_taxes.py").write_text("import time\nfrom taxes import add_tax\n\n\ndef test_it():\n"
                                            "    open('started', 'w').close()\n    time.sleep(60)\n")
    p = subprocess.Popen([sys.executable, str(PROBE), "taxes.py", "--", "test_taxes.py"], cwd=tmp_path,
                         stdout=subprocess.PIPE, text=True, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    deadline = time.time() + 120
    while not (tmp_path / "started").exists() and time.time() < deadline:
        time.sleep(0.1)
    assert (tmp_path / "taxes.py").read_text() != MODULE  # a mutant is in place while its tests run
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 143
    assert (tmp_path / "taxes.py").read_text() == MODULE
