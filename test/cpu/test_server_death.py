"""A server that dies mid-benchmark is told apart from a failed client: Server.death() names the error that ended
it, from the log lines SGLang writes when its scheduler crashes (shapes copied from real H200 crash logs)."""
from __future__ import annotations

import subprocess
import sys

from sglang_h20.nightly.serving import Server, crash_summary

OURS_CRASH = """[2026-11-30 05:57:02] Prefill batch, #new-seq: 1, #new-token: 64, #cached-token: 4032
[2026-11-30 05:57:02] Scheduler hit an exception: Traceback (most recent call last):
  File "/tmp/site/sglang/srt/managers/scheduler.py", line 4947, in run_scheduler_process
    scheduler.run_event_loop()
    module.per_token_group_quant(input, output_q, output_s)
  File "python/tvm_ffi/cython/function.pxi", line 968, in tvm_ffi.core.Function.__call__
RuntimeError: Failed at per_token_group_quant.cuh:511: CUDA error: an illegal memory access was encountered

[2026-11-30 05:57:02] SIGQUIT received. signum=None, frame=None. It usually means one child failed.
"""
UPSTREAM_CRASH = """ValueError: an earlier, handled warning that is not the crash
[2026-11-30 06:04:57] Scheduler hit an exception: Traceback (most recent call last):
    qo_indptr_host = qo_indptr.to("cpu")
                     ^^^^^^^^^^^^^^^^^^^
torch.AcceleratorError: CUDA error: an illegal memory access was encountered
Search for `cudaErrorIllegalAddress' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html
"""


def test_crash_summary_names_the_error_after_the_crash_mark():
    assert crash_summary(OURS_CRASH) == ("RuntimeError: Failed at per_token_group_quant.cuh:511: CUDA error: "
                                         "an illegal memory access was encountered")
    assert crash_summary(UPSTREAM_CRASH) == "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"
    assert crash_summary("[x] Decode batch, #running-req: 16\n[x] INFO: 200 OK\n") is None


def _server(tmp_path, log_text: str, code: str) -> Server:
    log = tmp_path / "server.log"
    log.write_text(log_text)
    srv = Server("/nonexistent-model", [], log)
    srv.proc = subprocess.Popen([sys.executable, "-c", code])
    return srv


def test_death_is_none_while_the_process_runs_and_the_error_after(tmp_path):
    srv = _server(tmp_path, OURS_CRASH, "import time; time.sleep(30)")
    try:
        assert srv.death() is None  # running: whatever the log says, it is not dead
    finally:
        srv.proc.kill()
        srv.proc.wait()
    assert "illegal memory access" in srv.death()


def test_death_without_a_traceback_gives_the_exit_code(tmp_path):
    srv = _server(tmp_path, "[x] Load weight end.\n", "raise SystemExit(3)")
    srv.proc.wait()
    assert srv.death() == "server exited with 3"
