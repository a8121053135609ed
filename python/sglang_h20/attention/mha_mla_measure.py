"""Prefill of one DeepSeek-V3 attention layer, MHA vs absorbed MLA, with SGLang 0.5.17's own Hopper kernels.

Why: the MHA/MLA prefill policy (sglang_h20.attention.mha_mla) needs per-GPU costs of both paths, and the
claim "ours is within 3% of the per-point best, upstream's fixed threshold is not" needs a measurement of both
paths at every point, on the same inputs.

Kernels (--kernels): flashinfer (default) runs what `--attention-backend flashmla` runs for prefill on Hopper:
FlashMLABackend hands EXTEND batches to its parent FlashInferMLAAttnBackend (flashinfer_mla_backend.py), so
both paths use flashinfer, with the flashmla backend's 64-token pages. fa3 runs what `--attention-backend fa3`
runs (sgl_kernel's FA3, page size 1), on hosts whose sgl_kernel ships flash_ops.

Shapes: 128 heads (TP1 / DP attention), kv_lora 512, qk_nope 128, qk_rope 64, v 128, bf16. A batch is B
requests of `extend` new tokens on `prefix` tokens whose latent KV [slots, 1, 576] is already in the cache.
Timed is the part that differs between the paths, from q (after q_b_proj and RoPE) and the latent cache to the
per-head output [tokens, 128, 128] that o_proj reads; q_a/q_b/kv_a projections, RoPE, the KV-cache write and
o_proj are the same for both and left out, so a loss measured here is an upper bound of the loss on the whole
layer. Per-batch metadata (flashinfer's plan(), fa3's page table) is built once per batch for all 61 layers in
SGLang and is not timed either (plan_ms records flashinfer's).

  MHA (forward_mha.py), the variant upstream's dispatch (_support_mha_one_shot) would run:
    one shot (sum of seq lens <= SGLANG_MAX_KV_CHUNK_CAPACITY, 128k): gather the latent of every prefix and
      new token (get_mla_kv_buffer_triton), kv_b_proj, k = concat_mla_k(k_nope, k_pe), one causal attention
      of the new tokens over prefix + new tokens: flashinfer BatchPrefillWithRaggedKVCacheWrapper.forward
      (FlashInferMhaChunkKVRunner, kv_indptr = cumsum(seq_lens)) or fa3 flash_attn_varlen_func;
    chunked: kv_b_proj of the new tokens' latent, concat_mla_k, causal ragged attention over the new tokens
      with lse (forward_return_lse / fa3 with lse); then per prefix chunk (capacity // B tokens per request, as
      prepare_chunked_prefix_cache_info): gather, kv_b_proj, k by slice copies, non-causal attention with lse
      (one ragged wrapper per chunk, as chunk_ragged_wrappers), merge_state_v2 (sgl_kernel). flashinfer's lse
      is base 2 and merge_state_v2 merges natural-log lse: SGLang 0.5.17 passes it as is, which weights the
      parts wrongly (sgl-project/sglang#40903); here it is multiplied by ln 2 first (a [T, 128] multiply per
      chunk), and the startup check records what the unconverted merge gives.
  MLA (forward_mla.py absorb path): q_nope x W_UK (torch.bmm), then
    flashinfer: q = cat(q_nope_out, q_pe) (flashmla is not in FORWARD_ABSORB_CORE_ATTENTION_BACKENDS) and
      BatchMLAPagedAttentionWrapper.run(q[..., :512], q[..., 512:], ckv, kpe) over the latent cache, planned
      causal with page_size 1 over token slots (FlashInferMLAAttnBackend.forward_extend, paged branch);
    fa3: flash_attn_with_kvcache with q = q_rope, qv = absorbed q_nope over the paged latent cache (k_cache =
      rope part, v_cache = 512-d latent), causal, num_splits 0;
    then x W_UV (torch.bmm, out=). SGLang takes this path only with a prefix (or in captured prefill); it is
    measured at prefix 0 too, as the cost the policy would pay there.
  kv_b_proj is a bf16 GEMM (F.linear, SGLang's unquantized linear) by default: SGLang runs DeepSeek-V3's FP8
  checkpoint through a block-FP8 GEMM (DeepGEMM on H200), so MHA's expansion is somewhat slower here than in
  such a server. --kv-b-proj fp8 uses SGLang's Triton block-FP8 linear (triton_w8a8_block_fp8_linear)
  instead. W_UK/W_UV are bf16 in both cases, as SGLang dequantizes them for Hopper.

Compilation: flashinfer JIT-builds its ragged-prefill and MLA modules on first plan (tens of seconds each
with nvcc, cached on disk after), Triton and concat_mla_k on first call: a tiny batch through each path builds
them all before any check or timing; the seconds are recorded (compile_s) and count against --deadline-s.

Timing: each path is run once (first-call costs; its output is the check below), then timed call by call with
CUDA events, the L2 flushed before each call, as many calls as fit --rep-ms (2..20 after one sizing call); the
median is reported. Eager, like SGLang's prefill. The validation batches run first, then the grid, cheapest
first; --deadline-s skips what is left (recorded with the reason), as does a point over the token budget
(B*(extend+prefix) > --max-tokens) or over the free GPU memory, or one a kernel refuses (with its error).

Check: at start, MHA (both variants, several prefix chunks) and MLA against a float32 reference on a small
mixed batch; at every point, MHA against MLA on the first request and both against the float32 reference on
its last query rows. Tolerance: relative Frobenius error <= 2e-2 (bf16 inputs and outputs; 5e-2 with
--kv-b-proj fp8, whose GEMM quantizes the latent to FP8).

Output (--json): per point mha_us, mla_us, best, the choice and loss vs best of each rule: upstream
(sglang_h20's UpstreamRule, SGLang's threshold), ours (the table fitted to this run's grid: in-sample there),
ours_loo (fitted without that point), linear (the fitted linear model without the measured grid), shipped
(the table in the package, if any, for this GPU), mha, mla; the same on --validate off-grid mixed batches
that no fit sees (ours out-of-sample); a summary with each rule's worst loss; the fitted table; provenance.
A PNG of MHA/MLA time over (se, total prefix) goes next to it. --write-table PATH writes the fitted table in
the format sglang_h20.attention.mha_mla.load_table reads (re-tune a GPU with that one command).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
import traceback
from pathlib import Path


from sglang_h20.attention.mha_mla import MLA_MAX_EXTEND_TOKENS, BatchShape, CostTable, UpstreamRule, grid_from_points, load_table  # noqa: E402

HEADS, KV_LORA, NOPE, ROPE, V_DIM, Q_LORA = 128, 512, 128, 64, 128, 1536
QK_DIM = NOPE + ROPE
SOFTMAX_SCALE = QK_DIM ** -0.5
EXTENDS = [128, 512, 1024, 2048, 4096, 8192, 16384]
PREFIXES = [0, 1024, 4096, 16384, 65536]
BATCHES = [1, 4, 16]
QUICK = {"batch": [1, 4], "extend": [512, 4096], "prefix": [0, 4096, 16384]}
MAX_TOKENS = 327_680  # 4 x (16k + 64k): keeps batch 4 on a 64k prefix; drops batch 16 on 64k and the largest 16k
CHUNK_CAPACITY = 128 * 1024  # SGLANG_MAX_KV_CHUNK_CAPACITY's default (read from SGLang when it imports)
PROVIDERS = ("flashinfer", "fa3")  # --kernels: the flashmla backend's prefill (flashinfer), or the fa3 backend's
FLASHMLA_PAGE = 64  # the flashmla backend forces page_size 64 (arg_groups/overrides.py)
FLASHINFER_WORKSPACE = 384 * 2**20  # SGLANG_FLASHINFER_WORKSPACE_SIZE's default
LN2 = math.log(2.0)  # flashinfer's lse is base 2, merge_state_v2 merges natural-log lse
TOLERANCE = 2e-2
TOLERANCE_FP8 = 5e-2  # --kv-b-proj fp8: MHA's K/V come from an FP8 GEMM of an FP8-quantized latent
TARGET_LOSS_PCT = 3.0
MAX_EXTEND_TOKENS = MLA_MAX_EXTEND_TOKENS + 1  # flashinfer's MLA prefill is wrong from here on (see mha_mla.py)
MLA_OVERFLOW = (f">= {MAX_EXTEND_TOKENS}: flashinfer's MLA prefill gives wrong results above {MLA_MAX_EXTEND_TOKENS} "
                "new tokens per batch; SGLang's chunked prefill keeps a batch below this")
RULES = ("upstream", "ours", "ours_loo", "linear", "shipped", "mha", "mla")
BENCH = "sglang_h20.attention.mha_mla_measure"  # run as benchmark/attention/mha_mla_layer.py or calibrate mha-mla


# --- plan, losses, table: pure Python -------------------------------------------------------------------------

def plan(batches, extends, prefixes, max_tokens: int) -> tuple[list[dict], list[dict]]:
    """Grid points to run, cheapest first, and the ones over the token budget (with the reason)."""
    run, skipped = [], []
    for b in batches:
        for e in extends:
            for p in prefixes:
                tokens = b * (e + p)
                pt = {"batch": b, "extend": e, "prefix": p}
                if tokens > max_tokens:
                    skipped.append({**pt, "reason": f"{tokens} tokens > budget {max_tokens} (--max-tokens)"})
                elif b * e >= MAX_EXTEND_TOKENS:
                    skipped.append({**pt, "reason": f"{b * e} new tokens: {MLA_OVERFLOW}"})
                else:
                    run.append(pt)
    run.sort(key=lambda q: (work(*lists(q)), q["batch"], q["extend"], q["prefix"]))
    return run, skipped


def validation_points(n: int, max_tokens: int, seed: int = 7) -> list[dict]:
    """Off-grid mixed batches (random sizes, lengths, some without prefix): the table never saw them."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        b = rng.choice([1, 2, 3, 5, 6, 8, 12])
        ext = [int(2 ** rng.uniform(7, 13.5)) for _ in range(b)]
        pre = [0 if rng.random() < 0.25 else int(2 ** rng.uniform(9, 16)) for _ in range(b)]
        if sum(ext) + sum(pre) <= max_tokens // 2 and sum(ext) < MAX_EXTEND_TOKENS:
            out.append({"batch": b, "extend": ext, "prefix": pre})
    return sorted(out, key=lambda q: work(*lists(q)))


def lists(pt: dict) -> tuple[list[int], list[int]]:
    """Per-request extend and prefix lengths of a grid point (uniform) or a validation point (lists)."""
    if isinstance(pt["extend"], list):
        return list(pt["extend"]), list(pt["prefix"])
    return [pt["extend"]] * pt["batch"], [pt["prefix"]] * pt["batch"]


def shape_of(pt: dict) -> BatchShape:
    return BatchShape(*lists(pt))


def work(extend: list[int], prefix: list[int]) -> float:
    """MACs of both paths (causal attention of each, MHA's kv_b_proj), to order points and predict time."""
    pairs = sum(e * (e / 2 + p) for e, p in zip(extend, prefix))
    tokens = sum(extend) + sum(prefix)
    return pairs * HEADS * (QK_DIM + V_DIM + KV_LORA + ROPE + KV_LORA) + tokens * KV_LORA * HEADS * 256


def one_shot(extend: list[int], prefix: list[int], capacity: int) -> bool:
    """Upstream's _support_mha_one_shot for fa3: the sum of sequence lengths fits one chunk."""
    return sum(extend) + sum(prefix) <= capacity


def prefix_chunks(prefix: list[int], capacity: int) -> list[list[tuple[int, int]]]:
    """Per chunk, each request's (start, length) in its prefix, as prepare_chunked_prefix_cache_info splits."""
    if not any(prefix):
        return []
    chunk_len = capacity // len(prefix)
    n = (max(prefix) + chunk_len - 1) // chunk_len
    return [[(c * chunk_len, max(0, min(p, (c + 1) * chunk_len) - c * chunk_len)) for p in prefix] for c in range(n)]


def estimate_bytes(extend: list[int], prefix: list[int], capacity: int = CHUNK_CAPACITY) -> int:
    """Peak GPU memory of a point: inputs plus the larger path (they run one after the other)."""
    n, t = sum(extend) + sum(prefix), sum(extend)
    inputs = n * 1152 + t * HEADS * QK_DIM * 2 + t * 1152
    per_expanded = 1152 + HEADS * 256 * 2 + HEADS * QK_DIM * 2  # gathered latent, kv, k
    if one_shot(extend, prefix, capacity):
        mha = n * per_expanded + t * HEADS * V_DIM * 2
    else:
        chunk = min(sum(prefix), capacity)
        mha = t * per_expanded + chunk * per_expanded + 3 * t * HEADS * (V_DIM * 2 + 4)
    mla = 2 * t * HEADS * KV_LORA * 2 + t * HEADS * V_DIM * 2
    check = 3 * HEADS * 16 * (extend[0] + prefix[0]) * 4  # float32 reference logits of 16 query rows
    return inputs + max(mha, mla) + check + 256 * 2**20  # + the L2-flush buffer


def loss_pct(pt: dict, method: str) -> float:
    return 100.0 * (pt[f"{method}_us"] / min(pt["mha_us"], pt["mla_us"]) - 1.0)


def fit_linear(points: list[dict]) -> dict[str, dict[str, float]]:
    """Non-negative least squares of each method's time on the features, in relative error (all sizes count)."""
    from sglang_h20.calibrate import nnls_fit

    coef = {}
    for m in ("mha", "mla"):
        rows = []
        for pt in points:
            f, t = shape_of(pt).features(), pt[f"{m}_us"]
            rows.append({k: v / t for k, v in f.items()})
        coef[m] = nnls_fit(rows, [1.0] * len(points))
    return coef


def fit_table(gpu: str, points: list[dict], meta: dict | None = None, grid: bool = True) -> CostTable:
    """The policy table of measured grid points: linear models plus (grid=True) the measured grid."""
    coef = fit_linear(points)
    source = f"measured on {gpu} (layer-level: one DeepSeek-V3 attention layer, {BENCH})"
    return CostTable(gpu, source, coef["mha"], coef["mla"],
                     {"measured": True, "method": "measured layer-level", **(meta or {})},
                     grid_from_points(points) if grid else None)


def _judge(pt: dict, choice: dict[str, str]) -> None:
    pt["best"] = "mha" if pt["mha_us"] <= pt["mla_us"] else "mla"
    pt["choice"] = choice
    pt["upstream"], pt["ours"] = choice["upstream"], choice.get("ours")
    pt["loss_pct"] = {r: round(loss_pct(pt, c), 3) for r, c in choice.items()}


def evaluate(points: list[dict], gpu: str, upstream, shipped: CostTable | None,
             validation: list[dict] = ()) -> CostTable | None:
    """Each point's per-rule choice and loss; the table fitted to the grid points (None below 4 points).

    ours is in-sample on the grid (the measured faster path by construction), ours_loo is fitted without
    the point (its neighbours are then twice as far: pessimistic), and on validation points ours is
    out-of-sample.
    """
    table = fit_table(gpu, points) if len(points) >= 4 else None
    linear = fit_table(gpu, points, grid=False) if table else None
    for i, pt in enumerate(points):
        s = shape_of(pt)
        choice = {"upstream": upstream.choose(s), "mha": "mha", "mla": "mla"}
        if table:
            choice.update(ours=table.choose(s), linear=linear.choose(s),
                          ours_loo=fit_table(gpu, points[:i] + points[i + 1:]).choose(s))
        if shipped is not None:
            choice["shipped"] = shipped.choose(s)
        _judge(pt, choice)
    for pt in validation:
        s = shape_of(pt)
        choice = {"upstream": upstream.choose(s), "mha": "mha", "mla": "mla"}
        if table:
            choice.update(ours=table.choose(s), linear=linear.choose(s))
        if shipped is not None:
            choice["shipped"] = shipped.choose(s)
        _judge(pt, choice)
    return table


def rule_stats(points: list[dict], target: float = TARGET_LOSS_PCT) -> dict:
    """Worst and mean loss per rule, where the worst is, and how many points are over the target."""
    out = {}
    for r in RULES:
        vals = [(pt["loss_pct"][r], pt) for pt in points if r in pt.get("loss_pct", {})]
        if vals:
            worst, at = max(vals, key=lambda v: v[0])
            out[r] = {"worst_loss_pct": worst, "mean_loss_pct": sum(v for v, _ in vals) / len(vals),
                      "points_over_target": sum(v > target for v, _ in vals),
                      "worst_at": {k: at[k] for k in ("batch", "extend", "prefix")}}
    return out


def summarize(points: list[dict], skipped: list[dict], validation: list[dict] = (),
              target: float = TARGET_LOSS_PCT, tolerance: float = TOLERANCE) -> dict:
    """Per-rule losses on the grid and on the validation batches, and the output checks."""
    rules = rule_stats(points, target)
    out: dict = {"points": len(points), "skipped": len(skipped), "target_loss_pct": target, "rules": rules,
                 "validation_points": len(validation), "validation_rules": rule_stats(list(validation), target)}
    if "ours" in rules:
        out["ours_worst_loss_pct"] = rules["ours"]["worst_loss_pct"]
        out["ours_within_target"] = rules["ours"]["worst_loss_pct"] <= target
        out["ours_loo_worst_loss_pct"] = rules["ours_loo"]["worst_loss_pct"]
    if "upstream" in rules:
        out["upstream_worst_loss_pct"] = rules["upstream"]["worst_loss_pct"]
    v = out["validation_rules"]
    if "ours" in v:
        out["validation_ours_worst_loss_pct"] = v["ours"]["worst_loss_pct"]
        out["validation_upstream_worst_loss_pct"] = v["upstream"]["worst_loss_pct"]
    checks = [pt["check"]["max_rel"] for pt in [*points, *validation] if pt.get("check")]
    if checks:
        out.update(check_max_rel=max(checks), check_tolerance=tolerance, check_ok=max(checks) <= tolerance)
    return out


def table_record(table: CostTable, summary: dict, config: dict, provenance: dict,
                 carry_from: CostTable | None = None) -> dict:
    """The file load_table reads: the table, where and how it was measured, and its own losses.
    carry_from: the table this one replaces; its server-measured once-per-prefill MHA cost (which this
    layer-level run cannot see) is kept when it was measured on the same GPU."""
    d = table.to_json()
    if carry_from is not None and carry_from.gpu == table.gpu and carry_from.mha_prefix_overhead_us > 0:
        d["mha_prefix_overhead_us"] = carry_from.mha_prefix_overhead_us
        d["mha_prefix_overhead"] = {**carry_from.meta.get("mha_prefix_overhead", {}),
                                    "carried_from": carry_from.source}
    d.update({"provenance": provenance, "config": config,
              "fit": {"in_sample_worst_loss_pct": summary.get("ours_worst_loss_pct"),
                      "leave_one_out_worst_loss_pct": summary.get("ours_loo_worst_loss_pct"),
                      "linear_only_worst_loss_pct": summary["rules"].get("linear", {}).get("worst_loss_pct"),
                      "validation_worst_loss_pct": summary.get("validation_ours_worst_loss_pct"),
                      "upstream_worst_loss_pct": summary.get("upstream_worst_loss_pct")},
              "retune": "python -m sglang_h20 calibrate mha-mla"})
    return d


# --- GPU part ---------------------------------------------------------------------------------------------------

class Unavailable(RuntimeError):
    pass


def load_kernels(kv_b_proj: str = "bf16", kernels: str = "flashinfer"):
    """SGLang 0.5.17's Hopper prefill kernels of one provider; Unavailable, with the reason, where they cannot run.

    flashinfer: what --attention-backend flashmla runs for prefill (FlashMLABackend hands EXTEND batches to its
    parent FlashInferMLAAttnBackend); fa3: what --attention-backend fa3 runs (needs sgl_kernel's flash_ops).
    """
    import types

    import torch

    if kernels not in PROVIDERS:
        raise ValueError(f"kernels must be one of {PROVIDERS}, not {kernels!r}")
    if not torch.cuda.is_available():
        raise Unavailable("needs a CUDA GPU (Hopper, sm_90): none is visible")
    if torch.cuda.get_device_capability() < (9, 0):
        raise Unavailable(f"needs a Hopper GPU (sm_90); this is {torch.cuda.get_device_name()}")
    k = types.SimpleNamespace(torch=torch, device="cuda", provider=kernels, notes={"kernels": kernels}, compile_s={})
    try:
        from sgl_kernel import merge_state_v2

        from sglang.kernels.ops.kvcache.mla_buffer import get_mla_kv_buffer_triton
    except Exception as e:  # noqa: BLE001 - any import failure means: not runnable here
        raise Unavailable(f"SGLang / sgl_kernel kernels do not import ({type(e).__name__}: {e})") from e
    k.merge, k.gather = merge_state_v2, get_mla_kv_buffer_triton
    if kernels == "fa3":
        try:  # FA3 loads lazily on the first call: probe one token
            from sglang.kernels.ops.attention.flash_attention import flash_attn_varlen_func, flash_attn_with_kvcache

            x = torch.zeros(1, 1, 64, dtype=torch.bfloat16, device="cuda")
            cu = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
            flash_attn_varlen_func(q=x, k=x, v=x, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=1, max_seqlen_k=1,
                                   causal=True, ver=3)
        except (ImportError, OSError) as e:  # FA3 not built into this sgl_kernel (the devkit's); other errors fail
            raise Unavailable(f"fa3 does not run here ({type(e).__name__}: {str(e)[:200]}); --kernels flashinfer "
                              "runs the flashmla backend's prefill instead") from e
        k.varlen, k.kvcache, k.page = flash_attn_varlen_func, flash_attn_with_kvcache, 1
    else:
        try:
            import flashinfer
            from flashinfer import BatchMLAPagedAttentionWrapper, BatchPrefillWithRaggedKVCacheWrapper
        except Exception as e:  # noqa: BLE001
            raise Unavailable(f"flashinfer does not import ({type(e).__name__}: {str(e)[:200]}); "
                              "--kernels fa3 where sgl_kernel has FA3") from e
        k.ragged_cls, k.mla_cls, k.page = BatchPrefillWithRaggedKVCacheWrapper, BatchMLAPagedAttentionWrapper, \
            FLASHMLA_PAGE
        k.notes["flashinfer"] = getattr(flashinfer, "__version__", "unknown")
        workspace = FLASHINFER_WORKSPACE
        try:
            from sglang.srt.environ import envs

            workspace = envs.SGLANG_FLASHINFER_WORKSPACE_SIZE.get()
        except Exception:  # noqa: BLE001 - the default above is upstream's
            pass
        k.workspace = torch.empty(workspace, dtype=torch.uint8, device="cuda")  # one, shared, as SGLang's
    k.capacity, k.threshold = CHUNK_CAPACITY, UpstreamRule().threshold
    try:
        from sglang.srt.environ import envs

        k.capacity = envs.SGLANG_MAX_KV_CHUNK_CAPACITY.get()
        k.threshold = envs.SGLANG_CHUNKED_PREFIX_CACHE_THRESHOLD.get()
    except Exception:  # noqa: BLE001 - the defaults above are upstream's
        pass
    ts = time.time()
    try:  # JIT (tvm-ffi); SGLang itself uses it for 128 heads / 128 nope / 64 rope
        from sglang.kernels.ops.attention.concat_mla import concat_mla_k

        x = torch.zeros(2, HEADS, QK_DIM, dtype=torch.bfloat16, device="cuda")
        concat_mla_k(x, torch.ones(2, HEADS, 256, dtype=torch.bfloat16, device="cuda")[..., :NOPE],
                     torch.ones(2, 1, ROPE, dtype=torch.bfloat16, device="cuda"))
        if not bool((x == 1).all()):
            raise RuntimeError("wrong output on a probe")
        k.concat = concat_mla_k
        k.notes["concat_k"] = "sglang.kernels.ops.attention.concat_mla.concat_mla_k (JIT)"
    except Exception as e:  # noqa: BLE001
        k.concat = None
        k.notes["concat_k"] = f"slice copies (concat_mla_k unavailable: {type(e).__name__}: {str(e)[:160]})"
    k.compile_s["concat_mla_k"] = time.time() - ts
    k.kv_b_proj, k.tolerance = kv_b_proj, TOLERANCE_FP8 if kv_b_proj == "fp8" else TOLERANCE
    if kv_b_proj == "fp8":
        from sglang.srt.layers.quantization.fp8_utils import triton_w8a8_block_fp8_linear

        k.fp8_linear = triton_w8a8_block_fp8_linear
    return k


def kernel_names(k) -> dict[str, list[str]]:
    """What each path calls, for the result record."""
    fi = k.provider == "flashinfer"
    kv_b = ("sglang fp8_utils.triton_w8a8_block_fp8_linear" if k.kv_b_proj == "fp8"
            else "torch F.linear bf16 (stand-in for the block-FP8 GEMM)")
    mha = ["sglang.kernels.ops.kvcache.mla_buffer.get_mla_kv_buffer_triton (latent gather)", "kv_b_proj: " + kv_b,
           "k: " + k.notes["concat_k"] + " (one shot / new tokens); slice copies (prefix chunks)"]
    if fi:
        mha += ["flashinfer BatchPrefillWithRaggedKVCacheWrapper(workspace, 'NHD', backend='auto'): begin_forward "
                "(causal over the new tokens or prefix + new; causal=False per prefix chunk), forward / "
                "forward_return_lse(sm_scale) (flashinfer_mla_backend.FlashInferMhaChunkKVRunner)",
                "sgl_kernel.merge_state_v2 (chunked prefix; flashinfer's base-2 lse x ln 2 first, which SGLang "
                "0.5.17 omits)"]
        mla = ["torch.bmm q_nope x W_UK", "torch.cat([q_nope_out, q_pe]) (flashmla is not in "
               "FORWARD_ABSORB_CORE_ATTENTION_BACKENDS)",
               "flashinfer BatchMLAPagedAttentionWrapper(workspace, backend='auto'): plan(page_size 1 over token "
               "slots, causal, sm_scale), run(q_nope, q_rope, ckv, kpe, out=) (FlashInferMLAAttnBackend.forward_"
               "extend, paged branch)", "torch.bmm x W_UV (out=)"]
    else:
        mha += ["sglang.kernels.ops.attention.flash_attention.flash_attn_varlen_func ver=3 -> sgl_kernel fa3",
                "sgl_kernel.merge_state_v2 (chunked prefix)"]
        mla = ["torch.bmm q_nope x W_UK", "sglang.kernels.ops.attention.flash_attention.flash_attn_with_kvcache "
               "ver=3 (q=q_rope, qv=absorbed q_nope, paged latent cache)", "torch.bmm x W_UV (out=)"]
    return {"mha": mha, "mla": mla}


class Layer:
    """Random DeepSeek-V3 kv_b_proj weights and the W_UK / W_UV views SGLang derives from them."""

    def __init__(self, k, seed: int = 0):
        torch = k.torch
        g = torch.Generator(device=k.device).manual_seed(seed)
        w = torch.randn(HEADS * (NOPE + V_DIM), KV_LORA, generator=g, device=k.device) / math.sqrt(KV_LORA)
        self.fp8 = k.kv_b_proj == "fp8"
        self.linear = torch.nn.functional.linear
        if self.fp8:  # 128x128 blocks, as DeepSeek-V3's checkpoint; W_UK/W_UV from the dequantized weight
            blocks = w.view(w.shape[0] // 128, 128, KV_LORA // 128, 128)
            self.w_scale = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-8) / 448.0
            self.w_fp8 = (blocks / self.w_scale[:, None, :, None]).to(torch.float8_e4m3fn).view_as(w)
            w = (self.w_fp8.float().view_as(blocks) * self.w_scale[:, None, :, None]).view_as(w)
            self.fp8_linear = k.fp8_linear
        self.w = w.to(torch.bfloat16).contiguous()  # [128 * 256, 512]: per head 128 k_nope rows, 128 v rows
        w_kc, w_vc = self.w.unflatten(0, (-1, NOPE + V_DIM)).split([NOPE, V_DIM], dim=1)
        self.w_kc = w_kc.transpose(1, 2).contiguous().transpose(1, 2)  # [H, 128, 512], as the weight loader
        self.w_vc = w_vc.contiguous().transpose(1, 2)  # [H, 512, 128]

    def kv_b_proj(self, kv_a):
        if self.fp8:
            return self.fp8_linear(kv_a, self.w_fp8, [128, 128], self.w_scale)
        return self.linear(kv_a, self.w)


class Batch:
    """Inputs of one prefill: q, the latent cache with each request's prefix and new tokens, kernel metadata.

    Slots are allocated in pages of k.page tokens (64 for the flashmla backend, 1 for fa3), page 0 being
    SGLang's padding page; each request's tokens are contiguous from a page start.
    """

    def __init__(self, k, extend: list[int], prefix: list[int], capacity: int, seed: int = 1):
        torch = k.torch
        dev, bf16, i32 = k.device, torch.bfloat16, torch.int32
        page = getattr(k, "page", 1)
        self.extend, self.prefix = list(extend), list(prefix)
        seq = [e + p for e, p in zip(extend, prefix)]
        self.B, self.T, self.N = len(seq), sum(extend), sum(seq)
        g = torch.Generator(device=dev).manual_seed(seed)
        pages = [-(-s // page) for s in seq]
        self.off = [page * (1 + sum(pages[:i])) for i in range(self.B)]  # request i owns off[i] .. off[i] + seq[i]
        self.kv_buffer = torch.randn(page * (1 + sum(pages)), 1, KV_LORA + ROPE, generator=g, device=dev, dtype=bf16)
        self.q = torch.randn(self.T, HEADS, QK_DIM, generator=g, device=dev, dtype=bf16)
        ext_loc = torch.cat([torch.arange(o + p, o + s, device=dev) for o, p, s in zip(self.off, prefix, seq)])
        self.kv_a = self.kv_buffer[ext_loc, 0, :KV_LORA].contiguous()  # the new tokens' normalized latent
        self.k_pe = self.kv_buffer[ext_loc, :, KV_LORA:].contiguous()  # [T, 1, 64]
        self.seq_lens = torch.tensor(seq, dtype=i32, device=dev)
        self.max_q, self.max_k = max(extend), max(seq)
        self.cu_q = torch.nn.functional.pad(torch.cumsum(torch.tensor(extend, device=dev), 0, dtype=i32), (1, 0))
        self.cu_k = torch.nn.functional.pad(torch.cumsum(self.seq_lens, 0, dtype=i32), (1, 0))
        self.page_table = torch.zeros(self.B, self.max_k, dtype=i32, device=dev)  # fa3's, page size 1
        for i, (o, s) in enumerate(zip(self.off, seq)):
            self.page_table[i, :s] = torch.arange(o, o + s, dtype=i32, device=dev)
        self.one_shot = one_shot(self.extend, self.prefix, capacity)
        self.has_prefix = any(prefix)
        self.all_loc = torch.cat([torch.arange(o, o + s, dtype=i32, device=dev) for o, s in zip(self.off, seq)])
        self.chunks = []
        if not self.one_shot:
            for parts in prefix_chunks(self.prefix, capacity):
                lens = [n for _, n in parts]
                loc = torch.cat([torch.arange(o + st, o + st + n, dtype=i32, device=dev)
                                 for o, (st, n) in zip(self.off, parts)])
                cu = torch.nn.functional.pad(torch.cumsum(torch.tensor(lens, device=dev), 0, dtype=i32), (1, 0))
                self.chunks.append((loc, cu, max(lens)))
        self.wrappers = {}  # flashinfer: planned wrappers by what they attend (SGLang plans once per batch)


def _ragged(k, X, kv, causal: bool):
    """The flashinfer ragged wrapper of X planned for `kv` ('all', 'new' or a prefix chunk index), as SGLang's
    FlashInferMhaChunkKVRunner.update_wrapper / FlashInferMLAIndicesUpdaterPrefill.call_begin_forward plan it."""
    key = ("ragged", kv, causal)
    if key not in X.wrappers:
        kv_indptr = X.cu_k if kv == "all" else X.cu_q if kv == "new" else X.chunks[kv][1]
        w = k.ragged_cls(k.workspace, "NHD", backend="auto")
        w.begin_forward(qo_indptr=X.cu_q, kv_indptr=kv_indptr, num_qo_heads=HEADS, num_kv_heads=HEADS,
                        head_dim_qk=QK_DIM, head_dim_vo=V_DIM, q_data_type=k.torch.bfloat16, causal=causal)
        X.wrappers[key] = w
    return X.wrappers[key]


def _mla_wrapper(k, X):
    """The flashinfer MLA paged wrapper of X, planned as FlashInferMLAIndicesUpdaterPrefill.call_begin_forward
    (paged branch): token slots as kv_indices, page_size 1 (also under the flashmla backend's 64-token pages)."""
    if "mla" not in X.wrappers:
        w = k.mla_cls(k.workspace, backend="auto")
        w.plan(X.cu_q, X.cu_k, X.all_loc, X.cu_k[1:] - X.cu_k[:-1], HEADS, KV_LORA, ROPE, 1, True, SOFTMAX_SCALE,
               k.torch.bfloat16, k.torch.bfloat16)
        X.wrappers["mla"] = w
    return X.wrappers["mla"]


def prepare(k, X, chunked: bool | None = None) -> None:
    """Plan what both paths of X need (per batch in SGLang, shared by all layers: not part of a layer's time)."""
    if k.provider != "flashinfer":
        return
    if X.one_shot if chunked is None else not chunked:
        _ragged(k, X, "all" if X.has_prefix else "new", True)
    else:
        _ragged(k, X, "new", True)
        for i in range(len(X.chunks)):
            _ragged(k, X, i, False)
    _mla_wrapper(k, X)


def _attend(k, X, key, v, kv, causal: bool, lse: bool, lse_to_e: bool = True):
    """MHA of the new tokens over `kv` ('all', 'new' or a prefix chunk index) -> out [T, H, 128], or
    (out, lse [T, H] in natural log, what merge_state_v2 computes with)."""
    if k.provider == "flashinfer":
        w = _ragged(k, X, kv, causal)
        fn = w.forward_return_lse if lse else w.forward
        out = fn(X.q, key, v, causal=causal, sm_scale=SOFTMAX_SCALE, logits_soft_cap=0.0)
        if not lse:
            return out
        o, s = out  # flashinfer's lse is base 2; SGLang 0.5.17 merges it as is (sgl-project/sglang#40903)
        return o, (s * LN2 if lse_to_e else s)
    cu_k, max_k = ((X.cu_k, X.max_k) if kv == "all" else (X.cu_q, X.max_q) if kv == "new"
                   else X.chunks[kv][1:])
    out = k.varlen(q=X.q, k=key, v=v, cu_seqlens_q=X.cu_q, cu_seqlens_k=cu_k, max_seqlen_q=X.max_q,
                   max_seqlen_k=max_k, softmax_scale=SOFTMAX_SCALE, causal=causal, return_softmax_lse=lse, ver=3)
    if not lse:
        return out
    return out[0], out[1].transpose(0, 1).contiguous()  # fa3's lse is [H, T]; SGLang transposes it


def _gather(k, X, loc):
    torch = k.torch
    nope = torch.empty(loc.shape[0], 1, KV_LORA, dtype=torch.bfloat16, device=loc.device)
    rope = torch.empty(loc.shape[0], 1, ROPE, dtype=torch.bfloat16, device=loc.device)
    k.gather(X.kv_buffer, loc, nope, rope)
    return nope.squeeze(1), rope


def _expand(k, L, kv_a, k_pe, fused_concat: bool):
    """kv_b_proj and the per-head K (nope | shared rope) and V, as forward_normal_prepare / the chunk loop."""
    torch = k.torch
    kv = L.kv_b_proj(kv_a).view(-1, HEADS, NOPE + V_DIM)
    k_nope, v = kv[..., :NOPE], kv[..., NOPE:]
    key = torch.empty(kv.shape[0], HEADS, QK_DIM, dtype=v.dtype, device=v.device)
    if fused_concat and k.concat is not None:
        k.concat(key, k_nope, k_pe)
    else:
        key[..., :NOPE] = k_nope
        key[..., NOPE:] = k_pe
    return key, v


def mha_forward(k, L, X, chunked: bool | None = None, lse_to_e: bool = True):
    """SGLang's MHA_ONE_SHOT or MHA_CHUNKED_KV core -> [T, H, 128]."""
    if not (X.one_shot if chunked is None else not chunked):
        return _mha_chunked(k, L, X, lse_to_e)
    if X.has_prefix:
        kv_a, k_pe = _gather(k, X, X.all_loc)
        kv = "all"
    else:
        kv_a, k_pe, kv = X.kv_a, X.k_pe, "new"
    key, v = _expand(k, L, kv_a, k_pe, fused_concat=True)
    return _attend(k, X, key, v, kv, causal=True, lse=False)


def _mha_chunked(k, L, X, lse_to_e: bool = True):
    torch = k.torch
    key, v = _expand(k, L, X.kv_a, X.k_pe, fused_concat=True)
    if not X.has_prefix:  # lse only where prefix chunks follow
        return _attend(k, X, key, v, "new", causal=True, lse=False)
    acc, lse = _attend(k, X, key, v, "new", causal=True, lse=True, lse_to_e=lse_to_e)
    del key, v
    for i, (loc, _, _) in enumerate(X.chunks):
        kv_a, k_pe = _gather(k, X, loc)
        key, v = _expand(k, L, kv_a, k_pe, fused_concat=False)  # the chunk loop builds k by slice copies
        o, s = _attend(k, X, key, v, i, causal=False, lse=True, lse_to_e=lse_to_e)
        new_acc, new_lse = torch.empty_like(acc), torch.empty_like(lse)
        k.merge(o, s, acc, lse, new_acc, new_lse)
        acc, lse = new_acc, new_lse
        del kv_a, k_pe, key, v, o, s
    return acc


def mla_forward(k, L, X):
    """SGLang's absorbed MLA extend -> [T, H, 128]: W_UK, the provider's latent-cache attention, W_UV."""
    torch = k.torch
    q_nope, q_pe = X.q.split([NOPE, ROPE], dim=-1)
    q_nope_out = torch.bmm(q_nope.transpose(0, 1), L.w_kc).transpose(0, 1)  # [T, H, 512]
    if k.provider == "flashinfer":  # forward_absorb_core's generic branch, then FlashInferMLAAttnBackend
        q = torch.cat([q_nope_out, q_pe], dim=-1)
        o = q.new_empty(X.T, HEADS, KV_LORA)
        attn = _mla_wrapper(k, X).run(q[..., :KV_LORA], q[..., KV_LORA:], X.kv_buffer[:, :, :KV_LORA],
                                      X.kv_buffer[:, :, KV_LORA:], out=o)
    else:
        k_rope_cache = X.kv_buffer[:, :, KV_LORA:].view(-1, 1, 1, ROPE)  # page size 1
        c_kv_cache = X.kv_buffer[:, :, :KV_LORA].view(-1, 1, 1, KV_LORA)
        o = k.kvcache(q=q_pe.view(-1, HEADS, ROPE), k_cache=k_rope_cache, v_cache=c_kv_cache,
                      qv=q_nope_out.view(-1, HEADS, KV_LORA), page_table=X.page_table, cache_seqlens=X.seq_lens,
                      cu_seqlens_q=X.cu_q, cu_seqlens_k_new=X.cu_k, max_seqlen_q=X.max_q,
                      softmax_scale=SOFTMAX_SCALE, causal=True, softcap=0.0, num_splits=0, ver=3)
        attn = o.view(-1, HEADS, KV_LORA)
    out = torch.empty(attn.shape[0], HEADS * V_DIM, dtype=attn.dtype, device=attn.device)
    torch.bmm(attn.transpose(0, 1), L.w_vc, out=out.view(-1, HEADS, V_DIM).transpose(0, 1))
    return out.view(-1, HEADS, V_DIM)


def compile_kernels(k, L, log=print) -> dict[str, float]:
    """Build each kernel variant once, before anything is checked or timed (flashinfer JIT-compiles on first
    plan, Triton on first call): seconds per step, kept apart from the timings."""
    torch = k.torch
    extend, prefix = [64, 32], [100, 0]
    steps = (("mha_one_shot", "MHA one shot: latent gather, kv_b_proj, causal ragged prefill", 1 << 20, False),
             ("mha_chunked", "MHA chunked: non-causal ragged prefill with lse, merge_state_v2", 64, True),
             ("mla", "MLA: W_UK bmm, paged MLA over the latent cache, W_UV bmm", 1 << 20, None))
    out = dict(k.compile_s)
    for name, what, capacity, chunked in steps:
        log(f"compiling / loading {what} ({k.provider}) ...")
        ts = time.time()
        X = Batch(k, extend, prefix, capacity, seed=3)  # planned lazily: each step builds only its own kernels
        if chunked is None:
            mla_forward(k, L, X)
        else:
            mha_forward(k, L, X, chunked=chunked)
        if k.device == "cuda":
            torch.cuda.synchronize()
        out[name] = time.time() - ts
        log(f"  {name}: {out[name]:.1f} s")
    return out


def reference_rows(k, L, X, req: int, rows: list[int], expanded: bool = False):
    """float32 attention of request `req`'s query rows (indices into its new tokens) -> [len(rows), H, 128].

    Latent form by default (memory stays small at 80k-token contexts); expanded=True builds per-head K/V
    like MHA does, to check the reference itself.
    """
    torch = k.torch
    e, p = X.extend[req], X.prefix[req]
    q0 = sum(X.extend[:req])
    c = X.kv_buffer[X.off[req]:X.off[req] + e + p, 0].float()  # [S, 576]
    q = X.q[q0:q0 + e][rows].float()  # [R, H, 192]
    w_kc, w_vc = L.w_kc.float(), L.w_vc.float()
    if expanded:
        k_nope = torch.einsum("sc,hdc->shd", c[:, :KV_LORA], w_kc)
        key = torch.cat([k_nope, c[:, None, KV_LORA:].expand(-1, HEADS, -1)], dim=-1)
        val = torch.einsum("sc,hcd->shd", c[:, :KV_LORA], w_vc)
        logits = torch.einsum("rhd,shd->hrs", q, key)
    else:
        q_lat = torch.einsum("rhd,hdc->rhc", q[..., :NOPE], w_kc)
        logits = torch.einsum("rhc,sc->hrs", q_lat, c[:, :KV_LORA]) + torch.einsum("rhd,sd->hrs", q[..., NOPE:],
                                                                                   c[:, KV_LORA:])
    pos = torch.tensor(rows, device=c.device)[:, None] + p  # causal: query at p + r sees keys 0 .. p + r
    mask = torch.arange(c.shape[0], device=c.device)[None, :] > pos
    prob = torch.softmax((logits * SOFTMAX_SCALE).masked_fill(mask[None], float("-inf")), dim=-1)
    if expanded:
        return torch.einsum("hrs,shd->rhd", prob, val)
    o_lat = torch.einsum("hrs,sc->hrc", prob, c[:, :KV_LORA])
    return torch.einsum("hrc,hcd->rhd", o_lat, w_vc)


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def check(k, L, X, mha_out, mla_out, rows: int = 16) -> dict:
    """MHA vs MLA on request 0, and both vs float32 on its last `rows` query rows."""
    e0 = X.extend[0]
    sel = list(range(max(0, e0 - rows), e0))
    ref = reference_rows(k, L, X, 0, sel)
    r = {"mha_vs_mla": rel(mha_out[:e0], mla_out[:e0]), "mha_vs_ref": rel(mha_out[sel], ref),
         "mla_vs_ref": rel(mla_out[sel], ref), "ref_rows": len(sel)}
    r["max_rel"] = max(r["mha_vs_mla"], r["mha_vs_ref"], r["mla_vs_ref"])
    return r


def startup_check(k, L) -> dict:
    """A small mixed batch through both MHA variants (chunked with several prefix chunks) and MLA vs float32."""
    extend, prefix = [37, 200, 64], [300, 0, 129]
    res, refs = {"extend": extend, "prefix": prefix}, None

    def vs_ref(out):
        return max(rel(out[sum(extend[:i]):sum(extend[:i + 1])], refs[i]) for i in range(len(extend)))

    for name, capacity, chunked in (("one_shot", 1 << 20, False), ("chunked", 128, True)):
        X = Batch(k, extend, prefix, capacity, seed=5)  # the same inputs for both: only the chunking differs
        if refs is None:
            refs = [reference_rows(k, L, X, i, list(range(e)), expanded=True) for i, e in enumerate(extend)]
        mha, mla = mha_forward(k, L, X, chunked=chunked), mla_forward(k, L, X)
        res[name] = {"chunks": len(X.chunks), "max_rel_vs_ref": max(vs_ref(mha), vs_ref(mla)),
                     "mha_vs_mla": rel(mha, mla)}
    res["max_rel"] = max(res["one_shot"]["max_rel_vs_ref"], res["chunked"]["max_rel_vs_ref"],
                         res["one_shot"]["mha_vs_mla"], res["chunked"]["mha_vs_mla"])
    res["ok"] = res["max_rel"] <= getattr(k, "tolerance", TOLERANCE)
    if getattr(k, "provider", "fa3") == "flashinfer":  # a record of what SGLang 0.5.17's merge gives (not checked)
        res["chunked_base2_lse_as_sglang_0_5_17"] = {
            "max_rel_vs_ref": vs_ref(mha_forward(k, L, X, chunked=True, lse_to_e=False))}
    return res


def time_us(k, fn, rep_ms: float, flush, warm: bool = True) -> tuple[float, int]:
    """Median µs of eager calls, each timed alone with CUDA events after an L2 flush (warm: call once first)."""
    torch = k.torch
    if warm:
        fn()
    torch.cuda.synchronize()

    def timed():
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        return s, e

    first = timed()
    torch.cuda.synchronize()
    est = first[0].elapsed_time(first[1])
    n = max(2, min(20, int(rep_ms / max(est, 1e-3))))
    pairs = [timed() for _ in range(n)]
    torch.cuda.synchronize()
    times = [est] + [s.elapsed_time(e) for s, e in pairs]
    return statistics.median(times) * 1e3, len(times)


def run_point(k, L, pt: dict, rep_ms: float, flush, seed: int) -> dict:
    """Check both paths' outputs (these first calls are the warm-up), then time each: one measured point."""
    extend, prefix = lists(pt)
    X = Batch(k, extend, prefix, k.capacity, seed=seed)
    if k.device == "cuda":
        k.torch.cuda.synchronize()  # plan() syncs with the host: leave the inputs' own work out of plan_ms
    ts = time.perf_counter()
    prepare(k, X)
    plan_ms = (time.perf_counter() - ts) * 1e3 if k.provider == "flashinfer" else None
    chk = check(k, L, X, mha_forward(k, L, X), mla_forward(k, L, X))
    mha_us, mha_n = time_us(k, lambda: mha_forward(k, L, X), rep_ms, flush, warm=False)
    mla_us, mla_n = time_us(k, lambda: mla_forward(k, L, X), rep_ms, flush, warm=False)
    return {**pt, "se": shape_of(pt).se, "total_prefix": sum(prefix), "tokens": sum(extend) + sum(prefix),
            "mha_variant": "one_shot" if X.one_shot else "chunked", "prefix_chunks": len(X.chunks),
            "mha_us": mha_us, "mla_us": mla_us, "mha_over_mla": mha_us / mla_us, "timed_calls": {"mha": mha_n,
            "mla": mla_n}, "plan_ms": plan_ms, "check": chk}


def run_all(k, L, todo: list[dict], a, t0: float, flush, done: list[dict], skipped: list[dict], on_point) -> None:
    """Run points in order into `done`, skipping (with the reason) those past the deadline, over the free
    memory, or refused by a kernel."""
    torch = k.torch
    rate = 0.0  # seconds per unit of work of the last (largest so far) point
    for i, pt in enumerate(todo):
        extend, prefix = lists(pt)
        w = work(extend, prefix)
        elapsed = time.time() - t0
        if a.deadline_s is not None and elapsed + rate * w > a.deadline_s:
            skipped.append({**pt, "reason": f"deadline: {elapsed:.0f}s elapsed, ~{rate * w:.0f}s more predicted, "
                                            f"--deadline-s {a.deadline_s:g}"})
            continue
        need, free = estimate_bytes(extend, prefix, k.capacity), torch.cuda.mem_get_info()[0]
        if need > 0.9 * free:
            skipped.append({**pt, "reason": f"memory: needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"})
            continue
        ts = time.time()
        try:
            row = run_point(k, L, pt, a.rep_ms, flush, seed=1000 + 7919 * i + len(done))
        except torch.cuda.OutOfMemoryError as ex:
            skipped.append({**pt, "reason": f"out of memory: {str(ex).splitlines()[0][:160]}"})
            continue
        except Exception as ex:  # noqa: BLE001 - a kernel refusing one shape is data, not the end of the run
            traceback.print_exc()
            skipped.append({**pt, "reason": f"error: {type(ex).__name__}: {str(ex).splitlines()[0][:200]}"})
            continue
        finally:
            torch.cuda.empty_cache()  # the next point's shapes differ: give the cached blocks back
        rate = (time.time() - ts) / w
        done.append(row)
        on_point(i, len(todo), row)


def plot(points: list[dict], path: Path, summary: dict) -> None:
    from sglang_h20.plotting import pyplot, save_png

    plt = pyplot()  # the GPU host's IPython stub broke a plain pyplot import (2026-11-29)

    fig, ax = plt.subplots(figsize=(9, 6))
    lim = max(abs(math.log2(pt["mha_us"] / pt["mla_us"])) for pt in points) or 1.0
    sc = None
    for b, marker in zip(sorted({pt["batch"] for pt in points}), "os^Dv"):
        pts = [pt for pt in points if pt["batch"] == b]
        sc = ax.scatter([pt["se"] for pt in pts], [pt["total_prefix"] + 1 for pt in pts],
                        c=[math.log2(pt["mha_us"] / pt["mla_us"]) for pt in pts], cmap="RdBu_r", vmin=-lim, vmax=lim,
                        marker=marker, s=90, label=f"batch {b}",
                        edgecolors=["k" if pt["loss_pct"]["upstream"] > TARGET_LOSS_PCT else "none" for pt in pts],
                        linewidths=1.5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("se = sum extend x (extend + prefix)")
    ax.set_ylabel("total prefix + 1 (tokens)")
    rules = summary.get("rules", {})
    title = "DeepSeek-V3 attention layer prefill: log2(MHA / MLA time) (red: MLA faster)"
    if "upstream" in rules and "ours" in rules:
        title += (f"\nworst loss vs best: upstream {rules['upstream']['worst_loss_pct']:.1f}% (black rings: > 3%), "
                  f"ours {rules['ours']['worst_loss_pct']:.1f}%, ours leave-one-out "
                  f"{rules['ours_loo']['worst_loss_pct']:.1f}%")
    ax.set_title(title, fontsize=9)
    fig.colorbar(sc, ax=ax, label="log2(MHA us / MLA us)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    save_png(fig, path, dpi=120)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the results here (rewritten after every point)")
    ap.add_argument("--png", type=Path, help="MHA/MLA ratio plot (default: next to --json)")
    ap.add_argument("--write-table", type=Path, help="write the fitted policy table here (load_table's format)")
    ap.add_argument("--quick", action="store_true", help=f"a small subset: {QUICK}")
    ap.add_argument("--batches", type=int, nargs="+", default=BATCHES,
                    help="requests per batch, B (default: %(default)s; ignored with --quick)")
    ap.add_argument("--extends", type=int, nargs="+", default=EXTENDS,
                    help="new tokens per request (default: %(default)s; ignored with --quick)")
    ap.add_argument("--prefixes", type=int, nargs="+", default=PREFIXES,
                    help="cached prefix tokens per request (default: %(default)s; ignored with --quick)")
    ap.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                    help="skip points with B*(extend+prefix) above this (default: %(default)s)")
    ap.add_argument("--rep-ms", type=float, default=40.0, help="timed calls per path and point fill about this")
    ap.add_argument("--deadline-s", type=float, help="stop starting points after this many seconds (from start)")
    ap.add_argument("--validate", type=int,
                    help="off-grid mixed batches, measured before the grid (default 12; 4 with --quick)")
    ap.add_argument("--kv-b-proj", choices=["bf16", "fp8"], default="bf16",
                    help="MHA's kv_b_proj GEMM: bf16 F.linear (default) or SGLang's Triton block-FP8 linear")
    ap.add_argument("--kernels", choices=PROVIDERS, default="flashinfer",
                    help="flashinfer: the flashmla backend's prefill (default); fa3: the fa3 backend's")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    t0 = time.time()
    a = parse_args(argv)
    if a.validate is None:
        a.validate = 4 if a.quick else 12
    grid = QUICK if a.quick else {"batch": a.batches, "extend": a.extends, "prefix": a.prefixes}
    todo, skipped = plan(grid["batch"], grid["extend"], grid["prefix"], a.max_tokens)
    try:
        k = load_kernels(a.kv_b_proj, a.kernels)
    except Unavailable as e:
        print(f"mha_mla_layer: {e}", file=sys.stderr)
        return 2
    from sglang_h20 import provenance

    torch = k.torch
    gpu = torch.cuda.get_device_name()
    upstream = UpstreamRule(k.threshold)
    try:
        shipped = load_table(gpu)
    except FileNotFoundError:
        shipped = None
    config = {"heads": HEADS, "kv_lora_rank": KV_LORA, "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE,
              "v_head_dim": V_DIM, "q_lora_rank": Q_LORA, "dtype": "bf16", "page_size": k.page,
              "softmax_scale": SOFTMAX_SCALE, "kv_b_proj": a.kv_b_proj, "mha_chunk_capacity": k.capacity,
              "upstream_threshold": k.threshold, "max_tokens": a.max_tokens, "rep_ms": a.rep_ms,
              "grid": grid, "quick": a.quick, "tolerance_rel_frobenius": k.tolerance, **k.notes}
    if k.provider == "flashinfer":
        config["sglang_backend"] = "flashmla (prefill delegated to FlashInferMLAAttnBackend)"
        config["flashinfer_workspace_bytes"] = k.workspace.numel()
    else:
        config["sglang_backend"] = "fa3"
    L = Layer(k)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=k.device)
    result = {"provenance": provenance.record(), "gpu": gpu, "config": config, "kernels": kernel_names(k),
              "shipped_table": None if shipped is None else shipped.source}
    print(f"[{time.time() - t0:5.0f}s] {gpu}; kernels: {k.provider}; {len(todo)} points to run, {len(skipped)} "
          f"over the token budget; concat: {k.notes['concat_k']}", flush=True)
    step = "compile"
    try:  # JIT builds first, timed apart: the deadline counts them, the timings do not
        result["compile_s"] = compile_kernels(k, L, log=lambda m: print(f"[{time.time() - t0:5.0f}s] {m}",
                                                                         flush=True))
        step = "startup check"
        result["startup_check"] = startup_check(k, L)
    except Exception as ex:  # noqa: BLE001 - the kernels do not run here: say so, keep the record
        traceback.print_exc()
        result["error"] = f"{step}: {type(ex).__name__}: {ex}"
        if a.json:
            _write(a.json, result)
        return 1
    sc = result["startup_check"]
    upstream_merge = sc.get("chunked_base2_lse_as_sglang_0_5_17")
    print(f"[{time.time() - t0:5.0f}s] startup check vs float32: max rel {sc['max_rel']:.4f} "
          f"({'ok' if sc['ok'] else 'FAIL'})" + ("" if upstream_merge is None else
          f"; chunked with SGLang 0.5.17's base-2 lse merge: {upstream_merge['max_rel_vs_ref']:.4f}"), flush=True)

    def progress(i, n, row):
        label = (f"B={row['batch']:2d} ext={row['extend']:5d} prefix={row['prefix']:5d}"
                 if not isinstance(row["extend"], list) else f"mixed B={row['batch']} tokens={row['tokens']}")
        print(f"[{time.time() - t0:5.0f}s] {i + 1}/{n} {label}: MHA({row['mha_variant']}) {row['mha_us']:10.1f} us  "
              f"MLA {row['mla_us']:10.1f} us  MHA/MLA {row['mha_us'] / row['mla_us']:5.2f}  "
              f"upstream->{upstream.choose(shape_of(row))}  check {row['check']['max_rel']:.4f}", flush=True)
        if a.json:
            _write(a.json, {**result, "points": points, "validation": validation, "skipped": skipped,
                            "partial": True})

    points, validation = [], []
    if a.validate:  # first: cheap, and the table's out-of-sample test
        print(f"[{time.time() - t0:5.0f}s] validation: {a.validate} off-grid mixed batches", flush=True)
        run_all(k, L, validation_points(a.validate, a.max_tokens), a, t0, flush, validation, skipped, progress)
    print(f"[{time.time() - t0:5.0f}s] grid: {len(todo)} points", flush=True)
    run_all(k, L, todo, a, t0, flush, points, skipped, progress)

    table = evaluate(points, gpu, upstream, shipped, validation)
    summary = summarize(points, skipped, validation, tolerance=k.tolerance)
    result.update({"points": points, "validation": validation, "skipped": skipped, "summary": summary,
                   "partial": False})
    if table is not None:
        record = table_record(table, summary, config, result["provenance"], carry_from=shipped)
        result["table"] = record
        if a.write_table:
            _write(a.write_table, record)
            print(f"wrote the table to {a.write_table}")
    png = a.png or (a.json.with_suffix(".png") if a.json else None)
    if png and points and table is not None:
        try:
            plot(points, png, summary)
            result["png"] = str(png)
        except Exception as ex:  # noqa: BLE001 - a plot failure must not lose the numbers
            print(f"plot failed: {type(ex).__name__}: {ex}", file=sys.stderr)
    if a.json:
        _write(a.json, result)
    for name, stats in (("grid", summary["rules"]), ("validation", summary["validation_rules"])):
        for r, s in stats.items():
            print(f"{name:10s} {r:9s} worst loss {s['worst_loss_pct']:7.2f}% at {s['worst_at']}, "
                  f"mean {s['mean_loss_pct']:6.2f}%, {s['points_over_target']} points over {TARGET_LOSS_PCT:g}%")
    ok = result["startup_check"]["ok"] and summary.get("check_ok", True)
    print(f"done in {time.time() - t0:.0f}s: {len(points)} points, {len(skipped)} skipped; "
          f"outputs agree within {k.tolerance:g}: {ok}")
    return 0 if ok and points else 1


def _write(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
