"""Our dense FP8 GEMM under SGLang's block-FP8 linears, only where this GPU's table says it wins.

Part of the swapAB switch (SGLANG_H20_SWAPAB=on): the attention projections (fused q_a/kv_a, q_b, o_proj) and
the shared expert's gate_up / down of DeepSeek-V3 are block-FP8 linears that run once per layer per decode step
with M = batch rows. Upstream runs them through `--fp8-gemm-backend`'s function, chosen once per layer at model
load (fp8_utils.dispatch_w8a8_block_fp8_linear looks the function up by name, so the hook is what it picks):
  triton     triton_w8a8_block_fp8_linear: per-token-group quant + w8a8_block_fp8_matmul_triton
  deep_gemm  deepgemm_w8a8_block_fp8_linear_with_fallback: per-token-group quant + DeepGEMM fp8_gemm_nt
Both hooks decide per call from host-known sizes only (CUDA-graph safe): M = rows, (N, K) = the weight; the
table's 'dense' entries (benchmark/kernels/bench_grouped_gemm.py --shapes dense --tune, timed against DeepGEMM
and SGLang's Triton GEMM) must show a variant of ours faster than the kernel that hook replaces (UPSTREAM_OF:
the Triton GEMM under the triton backend, DeepGEMM under deep_gemm) at the nearest measured M, else upstream runs
unchanged.
Ours: upstream's own quant kernel (row-major 1x128 scales), then sgl_kernel_ext.grouped_gemm_fp8.fp8_gemm_nt
with the table's tiles and k-slices. Calls we cannot serve (pre-quantized input, bias, UE8M0 or other scale
formats, non-bf16) stay upstream; each reason is logged once. Inside `sm_budget(n)` our GEMMs run beside another
kernel (sglang_h20.moe.sbo: the shared expert beside the routed experts): n programs of at most BESIDE_STAGES
pipeline stages, so they fit on SMs that already hold that kernel's programs (`beside_config`).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import logging

import torch

from sglang_h20 import runner_check
from sglang_h20.features import Hook
from sglang_h20.logonce import OnceLog

FP8_UTILS = "sglang.srt.layers.quantization.fp8_utils"
TRITON_LINEAR = FP8_UTILS + ".triton_w8a8_block_fp8_linear"
DEEPGEMM_LINEAR = FP8_UTILS + ".deepgemm_w8a8_block_fp8_linear_with_fallback"
QUANT_MODULE = "sglang.kernels.ops.quantization.fp8_kernel"
UPSTREAM_OF = {TRITON_LINEAR: "sglang-triton", DEEPGEMM_LINEAR: "deepgemm"}  # the table's provider names
FP8 = torch.float8_e4m3fn

log = logging.getLogger("sglang_h20.dense_linear")
_note = OnceLog(log, "dense linear: upstream for ")
_gpu: str | None = None  # set by hooks(); None: the table loader asks torch
_sm_budget: contextvars.ContextVar[int | None] = contextvars.ContextVar("sglang_h20_dense_sm_budget", default=None)


# Beside the routed experts' persistent grid: its swapAB programs (BLOCK_N 128, 4 stages) take 72 KB of shared memory
# each, two per SM, and its combine tail needs every one of them resident. The table's shared-expert tiles (6 stages,
# 108 KB for gate_up; compile_report.py) do not fit next to two of them in an SM's 227 KB; 3 stages (54 KB) do.
BESIDE_STAGES = 3


def beside_config(config: dict | None) -> dict:
    """A table config made to run beside another kernel: one program per budgeted SM, at most BESIDE_STAGES stages
    (the same tiles and k-slices, so the same result bits)."""
    config = dict(config or {})
    config["num_stages"] = min(config.get("num_stages", BESIDE_STAGES), BESIDE_STAGES)
    config["programs_per_sm"] = 1
    return config


@contextlib.contextmanager
def sm_budget(num_sms: int | None):
    """Our dense GEMMs issued inside run beside another kernel: num_sms programs of `beside_config` tiles (None: as
    the table says, on every SM). Read when a kernel is launched, so a CUDA graph captured inside keeps it."""
    token = _sm_budget.set(num_sms)
    try:
        yield
    finally:
        _sm_budget.reset(token)


def reset(gpu_name: str | None = None) -> None:
    """Forget cached decisions and logged reasons; `gpu_name` names the table to use."""
    global _gpu
    _gpu = gpu_name
    _note.clear()
    _choice.cache_clear()


@functools.lru_cache(maxsize=4096)
def _choice(m: int, n: int, k: int, gpu_name: str | None, against: str):
    from sgl_kernel_ext import gemm_table

    choice = gemm_table.table_choice(m, n, k, 1, "dense", gpu_name, against)
    (log.debug if choice.best == "upstream" else log.info)(
        "dense linear M=%d N=%d K=%d -> %s vs %s (%s)", m, n, k, "upstream" if choice.best == "upstream" else
        f"ours ({choice.best})", against, choice.why)
    return choice


def unsupported(input, weight, block_size, weight_scale, input_scale, bias) -> str | None:
    """Why ours cannot serve this linear call (None: it can). Host-side attribute checks only."""
    if input_scale is not None:
        return "linears with a pre-quantized input"
    if bias is not None:
        return "linears with a bias"
    if list(block_size) != [128, 128]:
        return f"block shape {list(block_size)} (ours: [128, 128])"
    if input.dtype != torch.bfloat16 or weight.dtype != FP8 or weight.dim() != 2 or not weight.is_contiguous():
        return f"linears of {input.dtype} x {weight.dtype} (ours: bf16 x contiguous e4m3 [N, K])"
    n, k = weight.shape
    if k % 128 or input.shape[-1] != k:
        return f"linears with K={k} (ours: a multiple of 128)"
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != (-(-n // 128), k // 128):
        return f"weight scales {weight_scale.dtype} {tuple(weight_scale.shape)} (ours: fp32 128x128 blocks)"
    return None


def dense_linear(input, weight, weight_scale, choice) -> torch.Tensor:
    """out[..., N] = input[..., K] @ weight[N, K]^T in bf16: upstream's 1x128 quant, then our GEMM."""
    from sgl_kernel_ext import grouped_gemm_fp8 as gg

    k = weight.shape[1]
    x = input.reshape(-1, k).contiguous()  # upstream's quant asserts it (a no-op for the usual rows)
    q, scale = importlib.import_module(QUANT_MODULE).per_token_group_quant_fp8(x, 128, column_major_scales=False)
    budget = _sm_budget.get()
    config = choice.config if budget is None else beside_config(choice.config)
    out = gg.fp8_gemm_nt(q, scale, weight, weight_scale, variant=choice.best, config=config, num_sms=budget)
    return out.view(*input.shape[:-1], weight.shape[0])


def _around(against: str, original, input, weight, block_size, weight_scale, input_scale, bias):
    why = unsupported(input, weight, block_size, weight_scale, input_scale, bias)
    if why is None:
        m = input.numel() // max(input.shape[-1], 1)
        if m > 0:
            choice = _choice(m, weight.shape[0], weight.shape[1], _gpu, against)
            if choice.best != "upstream":
                return dense_linear(input, weight, weight_scale, choice)
    else:
        _note(why)
    return original(input, weight, block_size, weight_scale, input_scale, bias)


def triton_linear_hook(original, input, weight, block_size, weight_scale, input_scale=None, bias=None):
    """AROUND triton_w8a8_block_fp8_linear (same parameters): ours where the table has it beat the Triton GEMM."""
    return _around(UPSTREAM_OF[TRITON_LINEAR], original, input, weight, block_size, weight_scale, input_scale, bias)


def deepgemm_linear_hook(original, input, weight, block_size, weight_scale, input_scale=None, bias=None):
    """AROUND deepgemm_w8a8_block_fp8_linear_with_fallback (same parameters): ours where the table has it beat
    DeepGEMM's GEMM."""
    return _around(UPSTREAM_OF[DEEPGEMM_LINEAR], original, input, weight, block_size, weight_scale, input_scale,
                   bias)


def hooks() -> list[Hook]:
    """Both backends' linears (the table decides per shape; a GPU without 'dense' entries keeps upstream), and one
    line once the model has loaded if its block-FP8 linears picked another backend's function."""
    return [Hook(TRITON_LINEAR, triton_linear_hook, "around"), Hook(DEEPGEMM_LINEAR, deepgemm_linear_hook, "around"),
            runner_check.after_load(_note, unseen_linears, unseen_message)]


HOOKED = tuple(target.rsplit(".", 1)[1] for target in UPSTREAM_OF)  # the function names our two hooks wrap


def unseen_linears(model) -> list[str]:
    """The block-FP8 linear functions of the loaded model that neither of our hooks wraps."""
    return sorted(runner_check.block_fp8_linears(model) - set(HOOKED))


def unseen_message(names: list[str]) -> str:
    return (f"every block-FP8 linear on {', '.join(names)}: ours replaces {' and '.join(HOOKED)} "
            f"(--fp8-gemm-backend triton or deep_gemm)")


def dense_entries(table: dict) -> tuple[int, dict]:
    """(dense entries, {upstream provider: entries where ours beats it}) of a grouped-GEMM table."""
    from sgl_kernel_ext import gemm_table

    dense = [e for e in table.get("entries", []) if e.get("layout") == "dense"]
    return len(dense), {p: sum(gemm_table.entry_best(e, p) != "upstream" for e in dense) for p in UPSTREAM_OF.values()}
