"""with_mem_fraction: the benchmark servers' --mem-fraction-static, replaced when asked or on a GPU under 100 GiB
(an H100's server refused the scripts' 0.6 on dsv3-ep16-slice in session 29), kept on larger GPUs and without one."""
from __future__ import annotations

import types

import torch

from sglang_h20.nightly import serving


def test_explicit_fraction_replaces_the_flag_once():
    args = "--load-format dummy --mem-fraction-static 0.6 --cuda-graph-max-bs 64"
    assert serving.with_mem_fraction(args, 0.9) == "--load-format dummy --cuda-graph-max-bs 64 --mem-fraction-static 0.9"
    assert serving.with_mem_fraction("--load-format dummy", 0.5) == "--load-format dummy --mem-fraction-static 0.5"
    assert serving.with_mem_fraction("--mem-fraction-static=0.3 --x", 0.7) == "--x --mem-fraction-static 0.7"


def test_automatic_fraction_follows_the_gpu_memory(monkeypatch):
    args = "--load-format dummy --mem-fraction-static 0.6"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert serving.with_mem_fraction(args) == args  # no GPU here: left to the server
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for gib, want in ((141, args), (96, f"--load-format dummy --mem-fraction-static {serving.SMALL_GPU_MEM_FRACTION}"),
                      (80, f"--load-format dummy --mem-fraction-static {serving.SMALL_GPU_MEM_FRACTION}")):
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda i, gib=gib: types.SimpleNamespace(total_memory=gib * 2**30))
        assert serving.with_mem_fraction(args) == want, gib
