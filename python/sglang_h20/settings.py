"""Every SGLANG_H20_* switch in one typed place.

The environment is the source of truth because SGLang spawns its scheduler processes and
each of them loads plugins on its own; `--h20-*` flags on `python -m sglang.launch_server`
are parsed in the launching process and exported to the environment before anything is
spawned (`export_cli_args`, which the plugin hooks onto SGLang's `ServerArgs.from_cli_args`).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
from typing import Callable, Mapping

from sglang_h20 import cliargs

ENV_PREFIX = "SGLANG_H20_"
_TRUE = ("1", "on", "true", "yes")
_FALSE = ("0", "off", "false", "no", "")


class SettingError(ValueError):
    """A switch holds a value it does not accept; the message names the switch and the choices."""


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise SettingError(f"expected one of on/off/1/0/true/false, got {text!r}")


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        t = text.strip().lower()
        if t not in choices:
            raise SettingError(f"expected one of {'/'.join(choices)}, got {text!r}")
        return t

    parse.choices = choices
    return parse


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise SettingError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= v <= 1.0:
        raise SettingError(f"expected a number in [0, 1], got {text!r}")
    return v


_fraction.metavar = "FRACTION"


def _non_negative_int(text: str) -> int:
    try:
        return cliargs.non_negative_int(text.strip())
    except argparse.ArgumentTypeError as e:
        raise SettingError(str(e)) from None


_non_negative_int.metavar = "N"


def _path(text: str) -> str:
    return text.strip()


_path.metavar = "PATH"


def _design_options(text: str) -> tuple[str, ...]:
    """A list of the CUDA MLA kernels' -D design options (comma or space separated; 'none' or empty: none)."""
    names = [t for t in text.replace(",", " ").split() if t.lower() != "none"]
    bad = [n for n in names if not re.fullmatch(r"MLA_[A-Z0-9_]+", n)]
    if bad:
        raise SettingError(f"expected design options like MLA_EAGER_RESCALE, got {', '.join(map(repr, bad))}")
    return tuple(dict.fromkeys(names))


_design_options.metavar = "MLA_OPTION[,...]"


@dataclasses.dataclass(frozen=True)
class Switch:
    """One feature switch: its environment variable, its CLI flag, its parser and default."""

    name: str  # e.g. "fp8_mla" -> SGLANG_H20_FP8_MLA, --h20-fp8-mla
    parse: Callable[[str], object]
    default: str
    help: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flag(self) -> str:
        return "--h20-" + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        return "h20_" + self.name

    def show(self, value: object) -> str:
        """The value as a person would type it (on/off for booleans, a list comma-separated or 'none')."""
        if isinstance(value, bool):
            return "on" if value else "off"
        if isinstance(value, tuple):
            return ",".join(value) or "none"
        return str(value)

    def read(self, environ: Mapping[str, str]) -> object:
        raw = environ.get(self.env, self.default)
        try:
            return self.parse(raw)
        except SettingError as e:
            raise SettingError(f"{self.env}={raw!r}: {e}") from None


SWITCHES: tuple[Switch, ...] = (
    Switch("mha_mla_policy", _choice("upstream", "se", "mha", "mla"), "upstream",
           "prefill MHA/MLA choice: 'upstream' keeps SGLang's prefix-length rule, 'se' uses "
           "se=sum(extend*(extend+prefix)) with the per-GPU cost table, 'mha'/'mla' force one path "
           "(calibration, A/B)"),
    Switch("mha_mla_control", _path, "",
           "file holding the MHA/MLA policy ('se', 'upstream', 'mha', 'mla'), re-read while serving, so "
           "one server alternates policies in A/B runs (benchmark/serving/prefix_ttft.py --one-server); "
           "takes effect only when SGLANG_H20_MHA_MLA_POLICY is not 'upstream' (that installs the hook)"),
    Switch("fp8_mla", _parse_bool, "off",
           "FP8 MLA decode: FP8 KV cache with FP8 QK^T and PV on Hopper tensor cores"),
    Switch("fp8_mla_kernel", _choice("auto", "cuda", "cuda-v2", "cuda-v3", "triton"), "auto",
           "decode kernel of the h20_fp8_mla backend: 'auto' = the CUDA split kernel where it builds (sm_90 + "
           "nvcc; version 3 below batch 8 and for <= 32 query rows (16 heads x q_len <= 2), else version 2), "
           "else the Triton one; 'cuda' / 'cuda-v2' / 'cuda-v3' = one CUDA version ('cuda-v3' "
           "runs more than 32 rows as CTAs of 32, e.g. 128 heads as 4); 'triton' = the Triton kernel (A/B runs)"),
    Switch("fp8_mla_split_q", _parse_bool, "on",
           "the h20_fp8_mla backend takes Q as SGLang's two parts (latent, rope) instead of the copy SGLang joins "
           "them into for it: CUDA kernel versions 2 and 3 read both parts where they are (design option "
           "MLA_SPLIT_Q); on the H200 a dsv3-ep16-slice decode step at batch 48 x 4k took 28.35 against 29.45 ms of "
           "GPU span; 'off' for A/B runs"),
    Switch("fp8_mla_kernel_options", _design_options, "none",
           "A/B runs: extra design options every CUDA kernel version of the h20_fp8_mla backend is built with "
           "(sgl_kernel_ext.mla_decode_cuda.DESIGN_OPTIONS), e.g. MLA_EAGER_RESCALE (O rescaled on every tile, the "
           "merge lazy rescaling replaced); unknown ones make the backend fall back to Triton with the build's "
           "error"),
    Switch("swapab", _parse_bool, "off",
           "swapAB FP8 block-scaled grouped GEMMs for MoE with few tokens per expert, and our dense FP8 GEMM under "
           "SGLang's block-FP8 linears (attention projections, shared expert); each only where this GPU's table has "
           "ours faster than the kernel it replaces"),
    Switch("sbo", _parse_bool, "off",
           "single-batch overlap on SM90: MoE combine with the down GEMM, shared experts with dispatch; on one "
           "GPU our MoE path serves decode calls of up to 8 tokens per expert on the H200, 4 on the H100 "
           "(measured faster than upstream's there; other GPUs: 8), larger ones stay upstream's"),
    Switch("sbo_max_per_expert", _non_negative_int, "0",
           "with sbo on: our MoE path serves calls of up to this many tokens per expert, larger ones stay "
           "upstream's (0 = the cap measured on this GPU, see sbo); to re-tune on another GPU, compare "
           "benchmark/serving/swapab_e2e.py --arms off sbo at a few concurrencies with it set"),
    Switch("sbo_shared_sms", _non_negative_int, "0",
           "with sbo and swapab on: the shared expert, where it runs beside the routed experts on the layer's side "
           "stream, takes our dense GEMMs as this many programs of at most 3 pipeline stages, so they fit on SMs "
           "that hold the routed experts' persistent grid (0 = the table's tiles on every SM, as without it); an A/B "
           "knob: on the H200 no cap made the MoE layer faster (session 35)"),
    Switch("eplb", _choice("off", "affinity"), "off",
           "expert placement: 'affinity' = co-activation-aware EPLB with asynchronous migration"),
    Switch("eplb_async", _parse_bool, "off",
           "EPLB rebalance without decode stalls: placement in a background thread, weights moved "
           "on a side stream, each layer switched between forward passes once ready on all ranks"),
    Switch("eplb_async_launch", _choice("boundary", "thread"), "boundary",
           "who posts the migration's transfers: 'boundary' = the decode loop, between forward passes, in the "
           "same order on every rank (its NCCL kernels then sit at the same place among the model's); "
           "'thread' = a background thread, paced in GB/s (hung 3 of 4 EP-2 servers on the H200; A/B runs only)"),
    Switch("eplb_async_verify", _parse_bool, "off",
           "after each asynchronous rebalance, check every expert slot's bytes against its expert's bytes before "
           "the move (reads all expert weights twice, off the decode thread; one INFO or ERROR line per rank)"),
    Switch("eplb_async_shuffle", _parse_bool, "off",
           "benchmarks of the migration only: every asynchronous rebalance moves to a seeded permutation of the "
           "placement SGLang computed (nearly every slot moves, so one server times several full re-placements; "
           "balance per GPU is not kept)"),
    Switch("eplb_async_peer", _parse_bool, "off",
           "a transfer between GPUs of one node is pulled by its destination straight from the source's expert "
           "tensor, mapped over CUDA IPC at startup (the copy engines over NVLink: no SMs, no NCCL kernels, one side "
           "posts); a one-node plan is then posted by the transfer thread, and the decode loop only switches (15-29 "
           "us per boundary against NCCL's ~250-300); 'off' = NCCL send/recv posted by the decode loop. Decode p99 "
           "over a whole rebalance was not yet shown better than NCCL's (its placement phase dominates); falls back "
           "to NCCL where a rank cannot map"),
    Switch("eplb_affinity", _fraction, "0.25",
           "locality vs balance of the affinity placement: 0 = balance only, 1 = most locality"),
    Switch("dummy_router_clusters", _non_negative_int, "0",
           "benchmarks of expert placement on dummy weights only: after a --load-format dummy load, every MoE gate "
           "rewritten so that experts co-activate in seeded clusters of this size (0 = off; a real checkpoint is "
           "never touched)"),
    Switch("observe", _fraction, "0",
           "fraction of decode steps timed per stage with CUDA events (0 = off, e.g. 0.001): a sampled "
           "step replays an instrumented twin of its CUDA graph (eagerly without graphs: 9x a graph step "
           "on the 61-layer H200 run)"),
    Switch("observe_control", _path, "",
           "file holding the observe fraction, re-read while serving (flip observation on/off in one "
           "server; takes effect only when SGLANG_H20_OBSERVE > 0 installed the hooks)"),
    Switch("allow_untested", _parse_bool, "off",
           "let features turn on with an sglang version other than the tested one (at your own risk)"),
)
BY_NAME = {s.name: s for s in SWITCHES}


@dataclasses.dataclass(frozen=True)
class Settings:
    """Parsed values of every switch, plus the errors of those that failed to parse."""

    values: Mapping[str, object]
    errors: Mapping[str, str]

    def __getitem__(self, name: str) -> object:
        return self.values[name]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        environ = os.environ if environ is None else environ
        values, errors = {}, {}
        for s in SWITCHES:
            try:
                values[s.name] = s.read(environ)
            except SettingError as e:
                values[s.name] = s.parse(s.default)  # the feature stays at upstream behaviour
                errors[s.name] = str(e)
        return cls(values, errors)


def _argparse_type(switch: Switch) -> Callable[[str], str]:
    """argparse type: validate with the switch's parser, keep the text (it is exported as-is)."""

    def check(text: str) -> str:
        try:
            switch.parse(text)
        except SettingError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return text

    check.__name__ = switch.flag  # argparse names the type in its error message
    return check


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """Add the --h20-* flags; default None so an unset flag leaves the environment in charge."""
    group = parser.add_argument_group("sglang-h20 (plugin)", "Each flag overrides its SGLANG_H20_* variable.")
    for s in SWITCHES:
        choices = getattr(s.parse, "choices", None)
        group.add_argument(
            s.flag, dest=s.dest, default=None, type=_argparse_type(s),
            nargs="?" if s.parse is _parse_bool else None,
            const="on" if s.parse is _parse_bool else None,
            metavar="{" + ",".join(choices) + "}" if choices else ("{on,off}" if s.parse is _parse_bool
                                                                   else getattr(s.parse, "metavar", "VALUE")),
            help=f"{s.help} [env {s.env}, default {s.default}]",
        )


def export_cli_args(namespace: argparse.Namespace, environ: dict | None = None) -> dict[str, str]:
    """Copy the flags that were given into the environment, so spawned processes see them."""
    environ = os.environ if environ is None else environ
    exported = {}
    for s in SWITCHES:
        value = getattr(namespace, s.dest, None)
        if value is not None:
            environ[s.env] = exported[s.env] = str(value)
    return exported
