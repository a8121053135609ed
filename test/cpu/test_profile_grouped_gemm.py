"""profile_grouped_gemm's command line: our configs round-trip to the child, bad ones are refused, no ncu is said."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark" / "kernels"))
import profile_grouped_gemm as prof  # noqa: E402


def test_ours_configs_reach_the_child_unchanged(tmp_path):
    args = prof.parse_args(["--out", str(tmp_path), "--ours", "swapab:128x32x3x16", "normal:shipped",
                            "swapab:64x32x4x4:tma", "--upstream", "sglang-triton-swapab"])
    assert args.ours[0] == ("swapab", {"BLOCK_N": 128, "BLOCK_T": 32, "num_warps": 4, "num_stages": 3,
                                       "programs_per_sm": 16, "flat": False, "tma": False, "ws": False})
    assert args.ours[1] == ("normal", None) and args.ours[2][1]["tma"] and args.ours[2][1]["flat"]
    cmd = prof.child_command(args)
    again = prof.parse_args(cmd[cmd.index("--child") + 1:] + ["--child"])
    assert again.ours == args.ours and again.upstream == ["sglang-triton-swapab"] and again.child
    assert prof.labels(args)[1] == "ours-normal:shipped" and prof.labels(args)[-1] == "sglang-triton-swapab"


@pytest.mark.parametrize("bad", ["swapab", "swapab:128x32", "dense:128x32x3x16", "swapab:128x32x3x16:ws"])
def test_a_malformed_config_is_refused(tmp_path, bad, capsys):
    with pytest.raises(SystemExit):
        prof.parse_args(["--out", str(tmp_path), "--ours", bad])
    err = capsys.readouterr().err
    assert "want VARIANT" in err or "must be" in err


def test_without_ncu_it_says_so(tmp_path, capsys):
    assert prof.main(["--out", str(tmp_path), "--ncu", "no-such-ncu-binary"]) == 2
    assert "Nsight Compute is needed" in capsys.readouterr().err
