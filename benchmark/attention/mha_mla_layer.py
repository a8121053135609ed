#!/usr/bin/env python3
"""Prefill of one DeepSeek-V3 attention layer, MHA vs absorbed MLA, over extend x prefix x batch.

The measurement lives in the package, `sglang_h20.attention.mha_mla_measure` (its docstring says what is
timed, checked and written), so that `python -m sglang_h20 calibrate mha-mla` re-tunes a GPU with the same
code this benchmark runs. Options: --help.
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "python") not in sys.path:  # run from a checkout without installing
    sys.path.append(str(REPO / "python"))

from sglang_h20.attention.mha_mla_measure import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
