"""stop_servers_on_sigterm: `timeout`'s SIGTERM must unwind `with Server(...)` blocks (their __exit__ stops the
server's process group), not kill the benchmark on the spot and leave the server holding the GPU."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

CHILD = """
import sys, time
from pathlib import Path
from sglang_h20.nightly.serving import stop_servers_on_sigterm
stop_servers_on_sigterm()
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    Path(sys.argv[1]).write_text("unwound")
"""


def test_sigterm_runs_the_exit_path(tmp_path):
    marker = tmp_path / "marker"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(marker)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    t0 = time.time()
    child.send_signal(signal.SIGTERM)
    assert child.wait(30) == 128 + signal.SIGTERM
    assert marker.read_text() == "unwound" and time.time() - t0 < 30
