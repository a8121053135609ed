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


def usage() -> str:
    lines = ["usage: python -m sglang_h20 COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<10} {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines + ["", "python -m sglang_h20 COMMAND --help: the options of one command"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr)
        if argv:
            print(f"python -m sglang_h20: error: unknown command {argv[0]!r} "
                  f"(choose from {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
