"""swapAB FP8 block-scaled grouped GEMMs in SGLang's MoE, only where this GPU's table says they win.

Switch: SGLANG_H20_SWAPAB=on (--h20-swapab on). Two AROUND hooks; whenever a call is not ours,
upstream's function runs unchanged with the same arguments.

1. TRITON_MOE: `fused_experts` of `--moe-runner-backend triton` (single GPU / TP, a2a backend
   'none'). Ours for FP8 w8a8 experts with [128, 128] blocks, SiLU gating, bf16 activations. The
   decision uses host-known sizes only (CUDA-graph safe): P = tokens * top_k pairs over E experts,
   expected active experts a = E * (1 - (1 - 1/E)^P), m = P / a tokens each; the table's
   'contiguous' entries must name the same variant of ours for gate_up (N = 2I, K = H) and down
   (N = H, K = I) at (a groups, m tokens), else upstream (`plan_moe`). Our sequence:
     moe_align_block_size(topk_ids, BLOCK_T, E)  upstream's own alignment kernel, at our token tile
     hidden -> fp8 1x128 groups                  upstream's quant kernel (or the caller's a1_q)
     gate_up  m_grouped_fp8_gemm_nt_aligned      A rows read through sorted_token_ids in the kernel
     SiLU(gate) * up -> fp8                      one fused pass (silu_mul_quant_fp8); upstream: two
     down     m_grouped_fp8_gemm_nt_aligned      x routed weight x routed_scaling_factor in-epilogue
     sum over top_k                              torch.sum straight into the output
   Why the aligned layout: upstream sorts pairs by expert anyway; reading A through those ids costs
   one int32 load per row, while a sorted copy would cost a gather kernel and a pass over A. Every
   shape depends on (tokens, top_k, E) only, block counts are read on the GPU: no host sync.
2. DEEPEP_MASKED: DeepGEMM's masked grouped GEMM wrapper (the DeepEP low-latency path; its other
   callers have shapes the table does not hold and stay upstream). Ours when the table's 'masked'
   entries say so for (groups, expected_m, N, K); plain FP8 with fp32 scales and no overlap signal.

Table (sgl_kernel_ext.gemm_table.load_table): this user's re-tune
~/.cache/sglang_h20/grouped_gemm_<gpu>.json first, else the shipped
python/sglang_h20/tables/grouped_gemm_<gpu>.json. Re-tune on your GPU with one command:
    python benchmark/kernels/bench_grouped_gemm.py --tune [--groups <experts per GPU> ...]
3. The dense block-FP8 linears (attention projections, shared expert) of either --fp8-gemm-backend triton or
   deep_gemm: sglang_h20.dense_linear, by the same table's 'dense' entries.
No table for this GPU: no hooks at all, and the feature's one log line says so. A call we cannot serve (dtype,
quant config, block shape, activation...) goes upstream; each such reason is logged once.
Not hooked: the non-fused MoE runner path (LoRA, SGLANG_CI_DISABLE_MOE_FUSED_FUNC=1), and every other MoE runner
(DeepGEMM contiguous without DeepEP, flashinfer, cutlass, ...): once the model has loaded, one line names the runner
(`runner_check`).
"""
from __future__ import annotations

import functools
import importlib
import logging
import math
from typing import NamedTuple

import torch

from sglang_h20 import dense_linear, runner_check
from sglang_h20.features import Hook
from sglang_h20.logonce import OnceLog
from sglang_h20.settings import Settings

TRITON_MOE_MODULE = "sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe"
TRITON_MOE = TRITON_MOE_MODULE + ".fused_experts"
DEEPEP_MASKED = "sglang.srt.layers.deep_gemm_wrapper.entrypoint.grouped_gemm_nt_f8f8bf16_masked"
QUANT_KERNELS_MODULE = "sglang.kernels.ops.moe.fused_moe_triton_kernels"
FP8 = torch.float8_e4m3fn

log = logging.getLogger("sglang_h20.swapab")
_gpu: str | None = None  # set by hooks(); None: the loader asks torch
_note = OnceLog(log, "swapab: upstream for ")  # each reason for going upstream, once per process


def reset() -> None:
    """Forget cached decisions and logged reasons (tests, or after writing a new table)."""
    from sgl_kernel_ext import gemm_table

    gemm_table.forget_tables()
    _note.clear()
    plan_moe.cache_clear()
    _masked_choice.cache_clear()
    dense_linear.reset(_gpu)


# ---------------------------------------------------------------------------------------------
# Decisions (host-known sizes only, cached)
# ---------------------------------------------------------------------------------------------
class MoePlan(NamedTuple):
    variant: str  # 'swapab' | 'normal'
    block_t: int  # token tile = moe_align_block_size's block size
    gate_up: dict  # tile config overrides (the table's tuned ones)
    down: dict
    why: str


def expected_load(num_tokens: int, top_k: int, num_experts: int) -> tuple[float, float]:
    """(expected active experts, tokens per active expert) for uniform random routing."""
    pairs = num_tokens * top_k
    active = num_experts * (1.0 - (1.0 - 1.0 / num_experts) ** pairs)
    return active, pairs / max(active, 1e-9)


@functools.lru_cache(maxsize=4096)
def plan_moe(num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int,
             gpu_name: str | None = None) -> MoePlan | None:
    """Ours (a MoePlan) or upstream (None) for one fused MoE call; the table decides both GEMMs."""
    from sgl_kernel_ext import gemm_table
    from sgl_kernel_ext import grouped_gemm_fp8 as gg

    active, m = expected_load(num_tokens, top_k, num_experts)
    up = gemm_table.table_choice(m, 2 * inter, hidden, active, "contiguous", gpu_name)
    down = gemm_table.table_choice(m, hidden, inter, active, "contiguous", gpu_name)
    what = f"MoE {num_tokens} tokens x top-{top_k} over {num_experts} experts (~{active:.1f} active, m~{m:.1f})"
    if up.best == "upstream" or down.best != up.best:
        log.debug("swapab: %s -> upstream (gate_up: %s; down: %s)", what, up.why, down.why)
        return None
    if up.best not in gg.VARIANTS:  # 'split': two launches by count, which the aligned kernel's walk has not
        log.debug("swapab: %s -> upstream (measured best %s; the aligned kernel runs one variant)", what, up.best)
        return None
    if not (gg.aligned_runs(up.config) and gg.aligned_runs(down.config)):
        log.debug("swapab: %s -> upstream (measured on a walk the aligned kernel lacks: %s / %s)", what, up.config,
                  down.config)
        return None
    base = gg.heuristic_config(up.best, math.ceil(m), 2 * inter, hidden, round(active))
    block_t = {**base, **(up.config or {})}["BLOCK_T"]
    plan = MoePlan(up.best, block_t, dict(up.config or {}), dict(down.config or {}), f"{up.why}; {down.why}")
    log.info("swapab: %s -> ours (%s, token tile %d)", what, plan.variant, block_t)
    return plan


@functools.lru_cache(maxsize=1024)
def _masked_choice(expected_m: int, n: int, k: int, groups: int, gpu_name: str | None):
    from sgl_kernel_ext import gemm_table

    return gemm_table.table_choice(max(expected_m, 1), n, k, groups, "masked", gpu_name)


# ---------------------------------------------------------------------------------------------
# Hook 1: the Triton MoE runner's fused_experts
# ---------------------------------------------------------------------------------------------
def moe_unsupported(hidden_states, w1, w2, topk_ids, cfg, b1, b2, use_fp8_w8a8, use_int8_w8a8,
                    use_int8_w8a16, use_int4_w4a16, per_channel_quant, w1_scale, w2_scale,
                    block_shape, a1_q, a1_scale) -> str | None:
    """Why ours cannot serve this call (None: it can). Host-side attribute checks only."""
    if not use_fp8_w8a8 or use_int8_w8a8 or use_int8_w8a16 or use_int4_w4a16 or per_channel_quant:
        return "MoE weights that are not FP8 w8a8 block-quantized"
    if block_shape is None or list(block_shape) != [128, 128]:
        return f"MoE block shape {block_shape} (ours: [128, 128])"
    if b1 is not None or b2 is not None:
        return "MoE with biases"
    if cfg.activation != "silu" or not cfg.is_gated or cfg.gemm1_alpha is not None \
            or cfg.gemm1_clamp_limit is not None or getattr(cfg, "swiglu_limit", None) is not None:
        return f"MoE activation {cfg.activation} (gated={cfg.is_gated}, alpha/limits set?)"
    if cfg.no_combine or cfg.apply_router_weight_on_input:
        return "MoE with no_combine or router weights on the input"
    if hidden_states.dtype != torch.bfloat16 or hidden_states.dim() != 2:
        return f"MoE activations of dtype {hidden_states.dtype}, {hidden_states.dim()}-D"
    if w1.dtype != FP8 or w2.dtype != FP8 or w1_scale is None or w2_scale is None \
            or w1_scale.dtype != torch.float32 or w2_scale.dtype != torch.float32:
        return "MoE weights/scales that are not e4m3 with fp32 scales"
    e, n1, k = w1.shape
    inter = n1 // 2
    if k % 128 or inter % 128 or hidden_states.shape[1] != k or tuple(w2.shape) != (e, k, inter):
        return f"MoE shapes w1 {tuple(w1.shape)}, w2 {tuple(w2.shape)}"
    if tuple(w1_scale.shape) != (e, n1 // 128, k // 128) or tuple(w2_scale.shape) != (e, k // 128, inter // 128):
        return f"MoE weight scales {tuple(w1_scale.shape)}, {tuple(w2_scale.shape)} (not 128x128 blocks)"
    if a1_q is not None and (a1_scale is None or a1_q.dtype != FP8 or a1_scale.dtype != torch.float32):
        return "MoE with a pre-quantized input in another format"
    if topk_ids.dim() != 2:
        return "MoE top-k ids that are not [tokens, top_k]"
    return None


def _modules():
    return importlib.import_module(TRITON_MOE_MODULE), importlib.import_module(QUANT_KERNELS_MODULE)


def quantize_input(hidden_states, a1_q=None, a1_scale=None):
    """FP8 activations in 1x128 groups as upstream's fused_experts makes them, or the caller's pre-quantized."""
    if a1_q is not None:
        return a1_q, a1_scale
    fmk = _modules()[1]
    if hidden_states.is_cuda:
        return fmk.sglang_per_token_group_quant_fp8(hidden_states, 128)
    return fmk.per_token_group_quant_fp8(hidden_states, 128)


def output_like(hidden_states, inplace: bool):
    """The MoE output buffer as upstream allocates it: in place, or in symmetric memory when it feeds the
    symmetric-memory all-reduce."""
    if inplace:
        return hidden_states
    fm = _modules()[0]
    if fm.is_allocation_symmetric():
        with fm.use_symmetric_memory(fm.get_tp_group()):
            return torch.empty_like(hidden_states)
    return torch.empty_like(hidden_states)


def moe_forward(plan: MoePlan, hidden_states, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale,
                a1_q=None, a1_scale=None, inplace: bool = False, routed_scaling_factor=None) -> torch.Tensor:
    """The MoE layer through our kernels (see the module docstring for the sequence)."""
    from sgl_kernel_ext import grouped_gemm_fp8 as gg
    from sgl_kernel_ext.quant import silu_mul_quant_fp8

    fm = _modules()[0]
    num_tokens, hidden = hidden_states.shape
    num_experts, n1, _ = w1.shape
    top_k = topk_ids.shape[1]
    pairs = num_tokens * top_k
    sorted_ids, expert_ids, ntpp = fm.moe_align_block_size(topk_ids, plan.block_t, num_experts)
    a, a_scale = quantize_input(hidden_states, a1_q, a1_scale)
    h = torch.empty(pairs, n1, dtype=torch.bfloat16, device=hidden_states.device)
    gg.m_grouped_fp8_gemm_nt_aligned(a, a_scale, w1, w1_scale, sorted_ids, expert_ids, ntpp, pairs, h,
                                     plan.block_t, a_div=top_k, variant=plan.variant, config=plan.gate_up)
    q, q_scale = silu_mul_quant_fp8(h)
    y = torch.empty(pairs, hidden, dtype=torch.bfloat16, device=hidden_states.device)
    gg.m_grouped_fp8_gemm_nt_aligned(q, q_scale, w2, w2_scale, sorted_ids, expert_ids, ntpp, pairs, y,
                                     plan.block_t, a_div=1, topk_weights=topk_weights,
                                     weight_scale=1.0 if routed_scaling_factor is None else routed_scaling_factor,
                                     variant=plan.variant, config=plan.down)
    out = output_like(hidden_states, inplace)
    torch.sum(y.view(num_tokens, top_k, hidden), dim=1, out=out)
    return out


def fused_experts_hook(original, hidden_states, w1, w2, topk_output, moe_runner_config, b1=None, b2=None,
                       use_fp8_w8a8=False, use_int8_w8a8=False, use_int8_w8a16=False, use_int4_w4a16=False,
                       per_channel_quant=False, w1_scale=None, w2_scale=None, w1_zp=None, w2_zp=None,
                       a1_scale=None, a2_scale=None, block_shape=None, a1_q=None):
    """AROUND fused_experts (same parameters): ours where plan_moe says so, else upstream as called."""
    topk_weights, topk_ids = topk_output[0], topk_output[1]
    cfg = moe_runner_config
    why = moe_unsupported(hidden_states, w1, w2, topk_ids, cfg, b1, b2, use_fp8_w8a8, use_int8_w8a8,
                          use_int8_w8a16, use_int4_w4a16, per_channel_quant, w1_scale, w2_scale,
                          block_shape, a1_q, a1_scale)
    if why is None and torch.compiler.is_compiling():
        why = "MoE under torch.compile (upstream's custom op stays opaque to it)"
    if why is None and _modules()[0].get_exec().moe.enable_fused_moe_sum_all_reduce:
        why = "MoE with the fused sum + all-reduce (enable_fused_moe_sum_all_reduce)"
    plan = None
    if why is None:
        plan = plan_moe(hidden_states.shape[0], topk_ids.shape[1], w1.shape[0], w1.shape[2],
                        w1.shape[1] // 2, _gpu)
    else:
        _note(why)
    if plan is None:
        return original(hidden_states, w1, w2, topk_output, moe_runner_config, b1=b1, b2=b2,
                        use_fp8_w8a8=use_fp8_w8a8, use_int8_w8a8=use_int8_w8a8, use_int8_w8a16=use_int8_w8a16,
                        use_int4_w4a16=use_int4_w4a16, per_channel_quant=per_channel_quant,
                        w1_scale=w1_scale, w2_scale=w2_scale, w1_zp=w1_zp, w2_zp=w2_zp, a1_scale=a1_scale,
                        a2_scale=a2_scale, block_shape=block_shape, a1_q=a1_q)
    return moe_forward(plan, hidden_states, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale,
                       a1_q=a1_q, a1_scale=a1_scale if a1_q is not None else None, inplace=cfg.inplace,
                       routed_scaling_factor=cfg.routed_scaling_factor)


# ---------------------------------------------------------------------------------------------
# Hook 2: DeepGEMM's masked grouped GEMM (DeepEP low-latency)
# ---------------------------------------------------------------------------------------------
def masked_unsupported(lhs, rhs, out, masked_m, overlap_args, recipe_a, recipe_b) -> str | None:
    """Why ours cannot serve this masked GEMM call (None: it can)."""
    if overlap_args is not None:
        return "masked GEMMs with the down-GEMM overlap signal"
    if recipe_a is not None or recipe_b is not None:
        return "masked GEMMs with an FP4/MXFP8 recipe"
    (a, a_s), (b, b_s) = lhs, rhs
    if a.dtype != FP8 or b.dtype != FP8 or a_s.dtype != torch.float32 or b_s.dtype != torch.float32:
        return "masked GEMMs that are not e4m3 with fp32 scales (e.g. UE8M0-packed)"
    if a.dim() != 3 or b.dim() != 3 or out.dtype != torch.bfloat16 or masked_m.dtype != torch.int32:
        return "masked GEMMs of other ranks/dtypes"
    g, max_m, k = a.shape
    n = b.shape[1]
    if k % 128 or b.shape != (g, n, k) or tuple(a_s.shape) != (g, max_m, k // 128) \
            or tuple(b_s.shape) != (g, -(-n // 128), k // 128) or tuple(out.shape) != (g, max_m, n):
        return "masked GEMMs whose scales are not 1x128 / 128x128 blocks"
    return None


def masked_gemm_hook(original, lhs, rhs, out, masked_m, expected_m, overlap_args=None, max_block_n=256,
                     recipe_a=None, recipe_b=None):
    """AROUND grouped_gemm_nt_f8f8bf16_masked (same parameters): ours where the table says so."""
    why = masked_unsupported(lhs, rhs, out, masked_m, overlap_args, recipe_a, recipe_b)
    if why is None:
        g, _, k = lhs[0].shape
        n = rhs[0].shape[1]
        choice = _masked_choice(int(expected_m), n, k, g, _gpu)
        if choice.best != "upstream":
            from sgl_kernel_ext import grouped_gemm_fp8 as gg

            gg.m_grouped_fp8_gemm_nt_masked(lhs[0], lhs[1], rhs[0], rhs[1], masked_m, out=out,
                                            variant=choice.best, expected_m=int(expected_m),
                                            config=choice.config)
            return None  # what DeepGEMM returns without the overlap signal
    else:
        _note(why)
    return original(lhs, rhs, out, masked_m, expected_m, overlap_args=overlap_args, max_block_n=max_block_n,
                    recipe_a=recipe_a, recipe_b=recipe_b)


# ---------------------------------------------------------------------------------------------
# Feature entry
# ---------------------------------------------------------------------------------------------
def hooks(settings: Settings) -> list[Hook]:
    """The MoE and dense-linear hooks when this GPU has a table; none when it has not (Unsupported: the feature's one
    log line)."""
    global _gpu
    from sgl_kernel_ext import gemm_table

    from sglang_h20 import compat
    from sglang_h20.features import Unsupported

    g = compat.gpu()
    _gpu = g.name if g else gemm_table.this_gpu()
    reset()
    if gemm_table.load_table(_gpu) is None:
        raise Unsupported(f"there is no grouped-GEMM table for {_gpu} (looked for {gemm_table.user_table_path(_gpu)}, "
                          f"{gemm_table.table_path(_gpu)}; measure one with: python "
                          f"benchmark/kernels/bench_grouped_gemm.py --tune), so every MoE GEMM stays upstream")
    return [Hook(TRITON_MOE, fused_experts_hook, "around"), Hook(DEEPEP_MASKED, masked_gemm_hook, "around"),
            *dense_linear.hooks(),
            runner_check.moe_check(_note, runner_served, "the triton runner and DeepEP's masked DeepGEMM (the dense "
                                                          "linears still follow the table)")]


def runner_served(runner: str, a2a: str) -> bool:
    """Whether a MoE layer on this resolved runner reaches one of our MoE hooks: the triton runner's fused_experts,
    or DeepGEMM's masked grouped GEMM under DeepEP (its low-latency path)."""
    return runner == "triton" or (runner == "deep_gemm" and a2a == "deepep")


def enabled(settings: Settings) -> None:
    """Once on: the table in force (the plugin calls this after the feature's line)."""
    from sgl_kernel_ext import gemm_table

    table = gemm_table.load_table(_gpu)
    wins = sum(e["best"] != "upstream" for e in table["entries"])
    dense, dense_wins = dense_linear.dense_entries(table)
    other = "" if table.get("gpu") == _gpu else f" (measured on {table.get('gpu')}, running on {_gpu})"
    log.info("swapab: table %s%s, %s, %d entries (%d dense linears), ours fastest at %d; dense linears: ours faster "
             "than %s; ours only where it says so", table["path"], other, table.get("date"), len(table["entries"]),
             dense, wins, ", ".join(f"{p} at {n}" for p, n in dense_wins.items()))
