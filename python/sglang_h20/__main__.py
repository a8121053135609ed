"""python -m sglang_h20 {doctor, calibrate, eplb, nightly, observe}."""
from __future__ import annotations

import sys

COMMANDS = {
    "doctor": ("sglang_h20.doctor", "versions, GPU, and which features would activate, and why"),
    "calibrate": ("sglang_h20.calibrate", "measure per-GPU tables on this GPU (mha-mla)"),
    "eplb": ("sglang_h20.eplb.__main__", "expert placement: trace-driven simulator (simulate)"),
    "nightly": ("sglang_h20.nightly.__main__", "the nightly regression runner (run / compare)"),
    "observe": ("sglang_h20.observe.__main__", "decode-step observability: synth / analyze / report"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: python -m sglang_h20 COMMAND [ARGS]\n\ncommands:")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:<10} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    import importlib

    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
