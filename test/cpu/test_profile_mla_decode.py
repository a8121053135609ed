"""ncu_report's reading of an ncu --csv details page (every row kept, the headline metrics per launch) and
profile_mla_decode's use of it."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "kernels"))
import ncu_report  # noqa: E402
import profile_mla_decode as prof  # noqa: E402

CSV = '''"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","1","python3","h","mla_fp8_decode_kernel(mla_fp8_common::Params)","1","7","(256, 1, 1)","(2, 1, 64)","0","9.0","GPU Speed Of Light Throughput","Duration","nsecond","236,512"
"0","1","python3","h","mla_fp8_decode_kernel(mla_fp8_common::Params)","1","7","(256, 1, 1)","(2, 1, 64)","0","9.0","GPU Speed Of Light Throughput","Compute (SM) Throughput","%","41.7"
"0","1","python3","h","mla_fp8_decode_kernel(mla_fp8_common::Params)","1","7","(256, 1, 1)","(2, 1, 64)","0","9.0","Occupancy","Block Limit Registers","block","1"
"1","1","python3","h","flash_fwd_splitkv_mla_kernel","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","GPU Speed Of Light Throughput","Duration","nsecond","124,100"
"1","1","python3","h","flash_fwd_splitkv_mla_kernel","1","7","(256, 1, 1)","(132, 1, 1)","0","9.0","Command line profiler metrics","sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active","%","88.2"
'''


def test_details_are_parsed_and_the_headline_kept_per_launch():
    rows = ncu_report.parse_details(CSV)
    assert len(rows) == 5 and rows[0]["value"] == 236512.0 and rows[2]["metric"] == "Block Limit Registers"
    s = ncu_report.summarize(rows, prof.RAW_METRICS)
    ours = s["0: mla_fp8_decode_kernel(mla_fp8_common::Params)"]
    assert ours == {"Duration": [236512.0, "nsecond"], "Compute (SM) Throughput": [41.7, "%"]}
    fm = s["1: flash_fwd_splitkv_mla_kernel"]
    assert fm["sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"] == [88.2, "%"]
    assert "236512.0 nsecond" in ncu_report.table(s)


def test_without_ncu_it_says_so(tmp_path, capsys):
    assert prof.main(["--out", str(tmp_path), "--ncu", "no-such-ncu-binary"]) == 2
    assert "Nsight Compute is needed" in capsys.readouterr().err


def test_defines_reach_the_child_and_unknown_ones_are_refused(tmp_path, monkeypatch, capsys):
    """--defines profiles ours built with a design option (e.g. its bank conflicts); a typo is an error, not a
    default build profiled under the option's name."""
    import pytest
    args = prof.parse_args(["--out", str(tmp_path), "--defines", "MLA_VT_PRMT"])
    assert args.defines == ["MLA_VT_PRMT"]
    with pytest.raises(SystemExit):
        prof.parse_args(["--out", str(tmp_path), "--defines", "MLA_VT_NO_SUCH"])
    assert "not a design option" in capsys.readouterr().err
    seen = {}

    class Run:
        returncode, stdout, stderr = 1, "", ""

    def fake_run(cmd, **kw):
        seen.setdefault("cmd", cmd)
        return Run()
    monkeypatch.setattr(ncu_report, "find_ncu", lambda name: "/bin/true")
    monkeypatch.setattr(ncu_report.subprocess, "run", fake_run)
    assert prof.main(["--out", str(tmp_path), "--defines", "MLA_VT_LDSM"]) == 1  # the fake ncu "failed"
    cmd = seen["cmd"]
    assert cmd[cmd.index("--child"):][-2:] == ["--defines", "MLA_VT_LDSM"]


def test_every_cuda_version_can_be_profiled(tmp_path):
    """A provider per CUDA kernel version (version 3 since session 50: the one 'auto' runs below batch 8)."""
    from sgl_kernel_ext import mla_decode_cuda as cu
    names = {1: "ours-cuda", **{v: f"ours-cuda-v{v}" for v in cu.VERSIONS if v > 1}}
    assert set(names.values()) <= set(prof.PROVIDERS)
    assert {prof.cuda_version(n): n for n in names.values()} == names  # the kernel each provider profiles
    assert prof.parse_args(["--out", str(tmp_path), "--providers", "ours-cuda-v3", "flashmla-fp8"]).providers == \
        ["ours-cuda-v3", "flashmla-fp8"]
