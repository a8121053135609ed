"""profile_grouped_gemm's command line: our configs round-trip to the child, bad ones are refused, no ncu is said."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "kernels"))
import profile_grouped_gemm as prof  # noqa: E402


def test_ours_configs_reach_the_child_unchanged(tmp_path):
    args = prof.parse_args(["--out", str(tmp_path), "--ours", "swapab:128x32x3x16", "normal:shipped",
                            "swapab:64x32x4x4:tma", "swapab:128x32x3x16x160", "cuda:64x256-pd",
                            "cuda:128x192-s:mn", "--upstream", "sglang-triton-swapab"])
    assert args.ours[0] == ("swapab", {"BLOCK_N": 128, "BLOCK_T": 32, "num_warps": 4, "num_stages": 3,
                                       "programs_per_sm": 16, "flat": False, "tma": False, "ws": False})
    assert args.ours[1] == ("normal", None) and args.ours[2][1]["tma"] and args.ours[2][1]["flat"]
    assert args.ours[3][1]["maxnreg"] == 160 and "maxnreg" not in args.ours[0][1]
    assert args.ours[4] == ("cuda", {"form": "64x256-pd", "scales": "row-major"})
    assert args.ours[5] == ("cuda", {"form": "128x192-s", "scales": "mn-major"})
    cmd = prof.child_command(args)
    again = prof.parse_args(cmd[cmd.index("--child") + 1:] + ["--child"])
    assert again.ours == args.ours and again.upstream == ["sglang-triton-swapab"] and again.child
    assert prof.labels(args)[1] == "ours-normal:shipped" and prof.labels(args)[-1] == "sglang-triton-swapab"


@pytest.mark.parametrize("bad", ["swapab", "swapab:128x32", "dense:128x32x3x16", "swapab:128x32x3x16:ws",
                                 "swapab:128x32x3x16x160x1", "cuda:32x32",
                                 "cuda:128x128:km"])
def test_a_malformed_config_is_refused(tmp_path, bad, capsys):
    with pytest.raises(SystemExit):
        prof.parse_args(["--out", str(tmp_path), "--ours", bad])
    err = capsys.readouterr().err
    assert "want VARIANT" in err or "must be" in err or "forms are" in err


def test_without_ncu_it_says_so(tmp_path, capsys):
    assert prof.main(["--out", str(tmp_path), "--ncu", "no-such-ncu-binary"]) == 2
    assert "Nsight Compute is needed" in capsys.readouterr().err


def test_a_profile_run_writes_its_record(tmp_path, monkeypatch):
    """The parent's whole path with ncu faked: the report is written, read back, and the record holds the point,
    the providers in launch order and the per-launch summary (no details rows for this profiler)."""
    import json

    import ncu_report
    details = ('"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"\n'
               '"0","_fp8_grouped_gemm_kernel","GPU Speed Of Light Throughput","Duration","nsecond","75,232"\n'
               '"0","_fp8_grouped_gemm_kernel","Command line profiler metrics","dram__bytes_read.sum","byte","237706496"\n')

    class Run:
        def __init__(self, stdout=""):
            self.returncode, self.stdout, self.stderr = 0, stdout, ""

    def fake_run(cmd, **kw):
        if "-o" in cmd:
            (Path(cmd[cmd.index("-o") + 1]).with_suffix(".ncu-rep")).write_text("report")
            return Run()
        return Run(details if "details" in cmd else "raw,csv")
    monkeypatch.setattr(ncu_report, "find_ncu", lambda name: "/bin/ncu")
    monkeypatch.setattr(ncu_report.subprocess, "run", fake_run)
    assert prof.main(["--out", str(tmp_path), "--dist", "uniform", "--ours", "swapab:128x32x3x16"]) == 0
    rec = json.loads((tmp_path / "profile_grouped_gemm.json").read_text())
    assert rec["benchmark"] == "profile_grouped_gemm" and rec["point"]["counts"] == [32] * 8
    assert rec["providers_in_launch_order"][0].startswith("ours-swapab:") and "details" not in rec
    assert rec["summary"]["0: _fp8_grouped_gemm_kernel"] == {"Duration": [75232.0, "nsecond"],
                                                            "dram__bytes_read.sum": [237706496.0, "byte"]}
    assert rec["ncu"]["command"].startswith("/bin/ncu --clock-control none") and rec["raw_csv"] == "raw,csv"


def test_source_hotspots_rank_each_kernels_instructions(tmp_path, monkeypatch):
    """The source page's CSV (one block per kernel) -> per kernel the instructions with the most stall samples;
    the whole page kept compressed."""
    import lzma
    import subprocess
    import ncu_report

    head = '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",' \
        '"L1 Wavefronts Shared","stall_long_sb","stall_wait"'
    ours = ['"Kernel Name","void grouped_gemm_fp8_kernel<Form<128, 128>>(Params)",', head,
            '"0x10","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R1]","1,200","1,100","0","1,150","0"',
            '"0x20","QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4]","300","10","0","0","290"',
            '"0x30","FFMA R1, R2, R3, R1","5","1","0","0","5"']
    page = "\n".join(ours + ours + [  # ncu printed each of ours twice (session 45)
        '"Kernel Name","void deep_gemm::sm90_fp8_gemm_1d2d_impl<...>(...)",', head,
        '"0x10","WARPGROUP.DEPBAR.LE gsb0, 0x0","90","80","0","0","90"'])
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, page, ""))
    got = ncu_report.source_hotspots("ncu", tmp_path / "r.ncu-rep", tmp_path / "s.csv.xz", 10, top=2)
    assert [k["kernel"][:30] for k in got] == ["void grouped_gemm_fp8_kernel<F", "void deep_gemm::sm90_fp8_gemm_"]
    assert [r["Source"][:5] for r in got[0]["top"]] == ["SYNCS", "QGMMA"] and got[0]["samples"] == 1505
    assert got[0]["top"][0]["stall_long_sb"] == "1,150" and "stall_wait" not in got[0]["top"][0]  # zeros dropped
    assert "L1 Wavefronts Shared" not in got[0]["top"][1]
    assert got[1]["top"][0]["Address"] == "0x10" and len(got[1]["top"]) == 1
    assert lzma.decompress((tmp_path / "s.csv.xz").read_bytes()).decode() == page
