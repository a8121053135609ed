"""Our Triton kernels compile for sm_90a here, without a GPU, into the instructions they are meant to use.

Why: the CPU interpreter runs kernels without compiling them, so it missed a Triton error that only the sm_90
compile raises (two returns of different shapes in the grouped GEMM: every GPU test failed on the H200).
This runs benchmark/kernels/compile_report.py (Triton + its bundled ptxas, in a process without
TRITON_INTERPRET) and checks the resource report of each kernel family.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from repo_scripts import REPO

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
SPILL_BOUND = 64  # bytes: a few registers' worth; the shipped configs measured 0-4

pytestmark = pytest.mark.skipif(not PTXAS.exists(), reason="Triton's bundled ptxas is missing")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from sgl_kernel_ext import mla_decode as m

    meta = m.get_mla_decode_metadata(torch.tensor([4096]), 128, 1, num_sm=132)  # the shipped default
    cfg = f"{meta.block_h}x{meta.block_n}x{meta.block_v}x{meta.num_warps}x{meta.num_stages}" + \
        ("b" if meta.pv_16bit else "")
    out = tmp_path_factory.mktemp("compile") / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, str(REPO / "benchmark/kernels/compile_report.py"), "--mla-configs", cfg,
                        "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert out.exists(), r.stdout + r.stderr
    rep = json.loads(out.read_text())
    assert r.returncode == 0, r.stdout  # 1 when a variant failed to compile
    return cfg, rep


def test_mla_decode_default_config_uses_fp8_wgmma_and_tma(report):
    cfg, rep = report
    r = rep[f"mla_decode[{cfg}]"]
    assert any(x.endswith("e4m3.e4m3") for x in r["wgmma"]), r  # QK^T on FP8 tensor cores
    assert r["mma_sync"] == 0 and r["tma_copies"] > 0, r
    assert r["spill_bytes"] <= SPILL_BOUND, r


def test_grouped_gemm_and_sbo_kernels_compile_with_their_signals(report):
    _, rep = report
    gemms = {n: r for n, r in rep.items()  # (the K7168 pair: test_a_register_cap_makes_room_for_a_third_program)
             if n.startswith("grouped_gemm") and " ws" not in n and "K7168" not in n}
    combines = ("sbo_combine[masked wait]", "sbo_combine[contiguous wait]", "sbo_combine[contiguous]")
    assert len(gemms) == 11 and all(n in rep for n in combines), sorted(rep)
    for name, r in rep.items():
        assert r["spill_bytes"] <= SPILL_BOUND and r["mma_sync"] == 0, (name, r)
    assert all(any(x.endswith("e4m3.e4m3") for x in r["wgmma"]) for r in gemms.values()), gemms
    # the SBO contract: the GEMM publishes with a release atomic only when asked, the combine polls with
    # acquire atomics only when it waits, and accumulates with fp32 atomics
    assert [r["release_atomics"] for r in gemms.values()] == [0, 0, 1] + [0] * 8, gemms
    # the combine in the GEMM's epilogue (one GPU; inline or deferred to the program's end: one acq_rel count
    # per row and tile; tail: one grid-wide arrival per program), no float atomics
    assert [r["acq_rel_atomics"] >= 1 for r in gemms.values()] == [False, False, False, True, True, True, False,
                                                                    False, False, True, True], gemms
    # config tma: the FP8 operands by TMA (cp.async.bulk.tensor), the pointer configs by plain loads
    assert [r["tma_copies"] > 0 for r in gemms.values()] == [False] * 7 + [True] * 4, gemms
    # the inline combine keeps the flattened loop multi-buffered (the next tiles' loads in flight while a tile
    # counts): its shared memory is the plain flat loop's, not one stage's
    flat, flat_combine = gemms["grouped_gemm[masked swapab t16 flat tma]"], \
        gemms["grouped_gemm[masked swapab t16 flat tma combine]"]
    assert flat_combine["shared_bytes"] >= 0.9 * flat["shared_bytes"], (flat, flat_combine)
    assert all(r["f32_atomics"] == 0 for r in gemms.values()), gemms
    assert [rep[n]["acquire_atomics"] >= 1 for n in combines] == [True, True, False], {n: rep[n] for n in combines}
    assert all(rep[n]["f32_atomics"] >= 1 for n in combines), {n: rep[n] for n in combines}
    # and pauses between polls (the back-off that keeps it from taking the GEMM's issue slots)
    assert [rep[n]["nanosleeps"] >= 1 for n in combines] == [True, True, False], {n: rep[n] for n in combines}


def test_ep_combine_kernels_publish_at_system_scope(report):
    """The EP combine (sgl_kernel_ext.ep_combine): the producer's two arrivals (zero partial, epilogue) are release
    atomics at system scope (they land in another GPU's memory), its local count is acq_rel at GPU scope; the
    owner's finish acquires at system scope once per wait and pauses between polls."""
    _, rep = report
    prods = {n: r for n, r in rep.items() if n.startswith("ep_down_combine")}
    assert len(prods) == 5 and "ep_finish" in rep, sorted(rep)
    flat = prods["ep_down_combine[masked swapab t16 flat tma]"]  # operands by TMA, the loop multi-buffered
    assert flat["tma_copies"] > 0 and flat["shared_bytes"] > prods["ep_down_combine[masked swapab t16]"]["shared_bytes"]
    for name, r in prods.items():
        assert any(x.endswith("e4m3.e4m3") for x in r["wgmma"]), (name, r)
        assert r["release_atomics"] == 2 and r["sys_atomics"] == 2 and r["acq_rel_atomics"] == 1, (name, r)
        assert r["f32_atomics"] == 0 and r["spill_bytes"] <= SPILL_BOUND, (name, r)
    fin = rep["ep_finish"]
    assert fin["acquire_atomics"] == 1 and fin["sys_atomics"] == 1 and fin["nanosleeps"] >= 1, fin


def test_ws_config_is_warp_specialized_only_when_split(report):
    """config ws: the persistent walk over TMA boxes with FP8 wgmma and no spills. With ws_split Triton splits its
    tile loop into a TMA producer and MMA consumer warp groups (setmaxnreg moves registers between them; 12 warps
    for num_warps=4); Triton leaves a kernel unspecialized without an error when it cannot split it (num_warps=8, a
    flattened loop), so this checks that it happened, and that nothing else is specialized (the split hung on the
    H200 at num_stages=4, so it must stay opt-in). The token-tile map it reads compiles too (the interpreter would
    not catch a compile error)."""
    _, rep = report
    ws = {n: r for n, r in rep.items() if n.startswith("grouped_gemm") and " ws" in n}
    split = {n for n in ws if n.endswith(" ws split]")}
    assert len(ws) == 6 and len(split) == 3, sorted(rep)
    for name, r in ws.items():
        assert r["tma_copies"] > 0 and r["mma_sync"] == 0 and r["spill_bytes"] == 0, (name, r)
        assert any(x.endswith("e4m3.e4m3") for x in r["wgmma"]), (name, r)
        if name in split:
            assert r["setmaxnreg"] > 0 and r["num_warps"] == 12, (name, r)
    assert all(r["setmaxnreg"] == 0 for n, r in rep.items() if n not in split), "specialized where not asked"
    maps = {n: r for n, r in rep.items() if n.startswith("token_tile_map")}  # its first launch, 256 experts
    assert len(maps) == 2 and all(r["spill_bytes"] == 0 for r in maps.values()), maps


def test_a_register_cap_makes_room_for_a_third_program(report):
    """Session 43: ours' 128 x 32 swapAB tile, specialized as the bench launched it, takes 176 registers (Nsight
    Compute saw the same) and so two programs per SM where shared memory allows three; config maxnreg 160 makes it
    three, without spilling."""
    _, rep = report
    free = rep["grouped_gemm[contiguous swapab t32 K7168]"]
    capped = rep["grouped_gemm[contiguous swapab t32 K7168 maxnreg 160]"]
    assert free["registers"] > 170 and free["resident_per_sm"] == 2, free  # 176 here; 171+ leaves room for two
    assert capped["registers"] <= 160 and capped["spill_bytes"] == 0 and capped["resident_per_sm"] == 3, capped
    assert capped["shared_bytes"] == free["shared_bytes"]


def test_the_table_survey_builds_each_distinct_group_walk_config_once(tmp_path):
    """compile_report.py table: one variant per compile-relevant config of the table's MoE keys (the programs per SM
    it is launched with named), other walks and the dense linears left out."""
    sys.path.insert(0, str(REPO / "benchmark" / "kernels"))
    import compile_report as cr
    tile = {"BLOCK_N": 128, "BLOCK_T": 32, "num_warps": 4, "num_stages": 3, "programs_per_sm": 2}
    entries = [{"n": 4096, "k": 7168, "groups": 8, "m": 32, "layout": "masked", "best": "swapab",
                "config": {"swapab": tile, "normal": {**tile, "BLOCK_T": 64, "tma": True, "flat": True}}},
               {"n": 4096, "k": 7168, "groups": 8, "m": 24, "layout": "masked", "best": "upstream",
                "config": {"swapab": {**tile, "programs_per_sm": 16, "maxnreg": 160}}},
               {"n": 4096, "k": 7168, "groups": 8, "m": 16, "layout": "masked", "best": "swapab",
                "config": {"swapab": tile}},
               {"n": 2112, "k": 7168, "groups": 1, "m": 16, "layout": "dense", "best": "swapab",
                "config": {"swapab": tile}}]
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"entries": entries}))
    got = list(cr.table_variants(path))
    assert [v[0] for v in got] == ["table[masked swapab G8 K7168 128x32 w4 s3 launched 2 per SM]",
                                   "table[masked swapab G8 K7168 128x32 w4 s3 maxnreg 160 launched 16 per SM]"]
    name, fn, const, types, warps, stages, ones, divisible, cap = got[1]
    assert const["LAYOUT"] == 1 and const["SWAP_AB"] and (warps, stages, cap) == (4, 3, 160)
    assert "stride_ask" in ones and "stride_asm" not in divisible
