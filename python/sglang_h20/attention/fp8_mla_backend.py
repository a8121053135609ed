"""Attention backend `h20_fp8_mla`: DeepSeek MLA decode on an FP8 latent KV cache (sgl_kernel_ext.mla_decode).

Selecting it (precedence, decided once in the launching process, logged in one line):
1. `--attention-backend h20_fp8_mla` asks for it and switches the feature on (SGLANG_H20_FP8_MLA=on is exported
   to the processes SGLang spawns). If the feature cannot turn on here (no sm_90+, untested sglang, kernel does
   not import) or the launch is unsupported (model, dtype, ...), one line says why and SGLang picks its default
   backend instead; speculative decoding is refused with an error, as it has no verify path here.
2. `SGLANG_H20_FP8_MLA=on` (or `--h20-fp8-mla`) selects it when --attention-backend is unset or `flashmla` and no
   split prefill/decode backend is given; any other explicit backend is kept (and logged).
3. Otherwise upstream behaviour. `--prefill/--decode-attention-backend h20_fp8_mla` is an error: the backend
   owns the KV format, so it must serve both phases.
When selected: page size 64, `--kv-cache-dtype fp8_e4m3` (an explicit other KV dtype means "not ours"), no
captured prefill.

KV cache (fp8_kv_pool.FP8MLATokenToKVPool): the 576-channel latent in FP8 plus NUM_KV_SCALES float32 scales per
token, KV_BYTES_PER_TOKEN = 576 + 4 * NUM_KV_SCALES bytes per token per layer (584 today) against 1152 for BF16;
SGLang's pool sizing is told the same number through calculate_mla_kv_cache_dim. Every write quantizes only the
new tokens.

Decode: block tables from req_to_token (page 64), as upstream flashmla builds them, and the decode kernel
(`decode_kernel`: the CUDA one where it builds on sm_90, else mla_decode_fp8, the Triton one). The
split plan is computed in init_forward_metadata from a known max length (no device sync); under CUDA graphs
the block table and lengths live in static buffers that ops recorded in the graph itself refresh at every
replay (init_forward_metadata_in_graph: no host work per step); each captured batch size keeps the grid planned
at capture for the model's context length, and at each replay the split count the kernels use is set on the
device from the replay's longest sequence (mla_decode.set_splits: the same plan, tabulated per length at
capture; the programs past it return at once).

Prefill: DeepSeek's dispatch is upstream's (`_handle_attention_backend`, so the mha_mla policy applies):
* MHA (chunked-prefix form): SGLang's FlashInfer MLA backend's ragged and chunked-prefix MHA, exactly what
  upstream flashmla runs. It never reads the pool; the cached prefix reaches it through the pool's
  get_mla_kv_buffer, which dequantizes only the gathered tokens. (MHA one-shot is not offered: it is chosen by
  backend name upstream, and the chunked form covers the same batches.)
* MLA (absorbed, e.g. a short prefix): the prefix tokens are gathered and dequantized to BF16 and SGLang's
  Triton extend kernel attends over them plus the new tokens (the same kernel `--attention-backend triton` uses).
Without flashinfer every prefill takes the MLA form.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
import os
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch
from sgl_kernel_ext.hostmath import cdiv
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from sglang_h20.features import Hook
from sglang_h20.settings import BY_NAME, Settings

if TYPE_CHECKING:
    from sgl_kernel_ext.mla_decode import MLADecodeMetadata

NAME = "h20_fp8_mla"
KV_LORA_RANK, ROPE_DIM = 512, 64  # DeepSeek-V2/V3's MLA latent, the shape the kernel is built for
HEAD_DIM_QK = KV_LORA_RANK + ROPE_DIM
PAGE_SIZE = 64
DEEPSEEK_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
HANDLER_MODULE = "sglang.srt.models.deepseek_common.attention_backend_handler"
SELECT_TARGET = "sglang.srt.server_args.ServerArgs._handle_attention_backend_compatibility"
POOL_TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_mla_kv_pool"
CELL_TARGET = "sglang.srt.mem_cache.kv_cache_configurator.calculate_mla_kv_cache_dim"
SPLIT_FIELDS = ("prefill_attention_backend", "decode_attention_backend")

log = logging.getLogger("sglang_h20")


def _kernel():
    """sgl_kernel_ext.mla_decode, imported on first use: parsing the CLI must not depend on the kernel importing
    (the feature's guard reports that case)."""
    return importlib.import_module("sgl_kernel_ext.mla_decode")


class DecodeKernel(NamedTuple):
    fn: Callable        # mla_decode_fp8's signature
    plan: Callable      # its get_mla_decode_metadata
    splits_lut: Callable  # its split count for every length (CUDA graphs: mla_decode.set_splits at each replay)
    what: str
    takes_q_rope: bool = False  # fn accepts q_rope= (Q as latent and rope parts): the CUDA entry does


# 'auto' runs version 2 from this many sequences per call and version 3 below it, and version 3 for every call of
# at most mla_decode_cuda.V3_MAX_ROWS query rows (16 heads x q_len <= 2: TP8 layouts). Measured (H200, 128 heads,
# session 49: mla_decode_full_grid_s49_h200.json.xz at batch 1 and 16, mla_decode_h128_b2_b8_s49_h200.json.xz at 2, 4
# and 8; contexts 1k / 4k / 16k x q_len 1 / 2): version 3 in 32-row CTAs is the fastest of ours at every point of
# batch 1 (0.82-0.91x version 1's time) and at 1k contexts up to batch 16; version 2 at most 4k-16k points from batch
# 4 (up to 1.36x faster than v3 at 8 x 16k); version 1 at none. A batch-size rule, since a CUDA graph keeps the
# version of its batch size: with version 3 below 2 / 4 / 8 / 16 the geometric mean of time over the best of ours is
# 1.070 / 1.045 / 1.039 / 1.053 (1.145 for session 48's rule, version 1 below 16). At 16 heads version 3 was the
# fastest of the three at 16 of 24 points of the H100 grid of session 29 (mla_decode_full_grid_v3_h100.json) and
# within 3.5% at the others.
V2_FROM_BATCH = 8


def _auto_version(batch: int, rows: int, ok2: bool, ok3: bool, max_rows: int) -> int:
    """The version 'auto' runs for `batch` sequences of `rows` query rows each (heads x q_len), of those that
    build here (version 1 always does)."""
    if ok3 and (rows <= max_rows or batch < V2_FROM_BATCH):
        return 3
    return 2 if ok2 and batch >= V2_FROM_BATCH else 1


def _by_shape(fns: dict[int, Callable], version_of: Callable[[int, int], int]) -> Callable:
    """One decode function over the kernel versions (same arguments and results): `version_of(batch, rows)`'s."""
    def decode(q, *args, **kwargs):
        return fns[version_of(q.shape[0], q.shape[1] * q.shape[2])](q, *args, **kwargs)
    return decode


def _first_line(why: str) -> str:
    return why.splitlines()[0][:160] if why else "?"


def decode_kernel(choice: str | None = None, split_q: bool | None = None,
                  options: tuple[str, ...] | None = None) -> DecodeKernel:
    """(decode function, its split planner, its split table, what it is) for SGLANG_H20_FP8_MLA_KERNEL (`choice`;
    default: the environment's): the CUDA split kernel (FP8 wgmma for QK^T and PV) with its own plan (whole waves of
    one CTA per SM) where it builds and runs here (sm_90, nvcc), else the Triton kernel and its plan, with the
    reason. 'auto': version 3 below V2_FROM_BATCH sequences and for calls of at most 32 query rows, version 2 for the
    others (what cannot run is left out, with why; version 1 where neither builds), each planned for its own CTAs;
    'cuda' / 'cuda-v2' / 'cuda-v3': one version (v3 runs more rows as CTAs of 32, planned for them). Same arguments
    and format for all; the choice is logged once per process."""
    import functools

    settings = Settings.from_env() if None in (choice, split_q, options) else None
    if choice is None:
        choice = settings["fp8_mla_kernel"]
    if split_q is None:  # SGLANG_H20_FP8_MLA_SPLIT_Q: versions 2 and 3 built to read Q's two parts where they are
        split_q = settings["fp8_mla_split_q"]
    if options is None:  # SGLANG_H20_FP8_MLA_KERNEL_OPTIONS: design options for A/B runs
        options = settings["fp8_mla_kernel_options"]
    mla = _kernel()
    if choice == "triton":
        return DecodeKernel(mla.mla_decode_fp8, mla.get_mla_decode_metadata, mla.splits_lut,
                            "Triton (SGLANG_H20_FP8_MLA_KERNEL=triton)")
    version = {"cuda-v2": 2, "cuda-v3": 3}.get(choice, 1)
    try:
        cu = importlib.import_module("sgl_kernel_ext.mla_decode_cuda")
        ok, why = cu.available(version, _kernel_defines(version, split_q, options))
    except Exception as e:  # an import error must not take the Triton path down with it
        ok, why = False, f"{type(e).__name__}: {e}"
    if not ok:
        return DecodeKernel(mla.mla_decode_fp8, mla.get_mla_decode_metadata, mla.splits_lut,
                            f"Triton (CUDA kernel unavailable: {_first_line(why)})")
    kinds = ("(sm_90a, FP8 QK and PV" + (", Q read as two parts by v2/v3" if split_q else "")
             + "".join(f", {o}" for o in options) + ")")

    def version_fn(v):
        defines = _kernel_defines(v, split_q, options)
        return functools.partial(cu.mla_decode_fp8_cuda, version=v, defines=defines) if v > 1 or defines \
            else cu.mla_decode_fp8_cuda
    if version > 1:
        return DecodeKernel(version_fn(version), *cu.planners(version), f"CUDA v{version} {kinds}", True)
    if choice != "auto":
        return DecodeKernel(version_fn(1), cu.get_mla_decode_metadata, cu.splits_lut, f"CUDA {kinds}", True)
    (ok2, why2), (ok3, why3) = (cu.available(v, _kernel_defines(v, split_q, options)) for v in (2, 3))
    if not (ok2 or ok3):
        why = f"v2 unavailable: {_first_line(why2)}; v3 unavailable: {_first_line(why3)}"
        return DecodeKernel(version_fn(1), cu.get_mla_decode_metadata, cu.splits_lut, f"CUDA v1 {kinds}; {why}", True)
    version_of = functools.partial(_auto_version, ok2=ok2, ok3=ok3, max_rows=cu.V3_MAX_ROWS)
    rows = cu.V3_MAX_ROWS + 1  # the line is read off the rule itself: more rows than version 3 always takes
    what = f"CUDA v{version_of(1, rows)} below batch {V2_FROM_BATCH}, v{version_of(V2_FROM_BATCH, rows)} from there"
    what += f" (v3 for <= {cu.V3_MAX_ROWS} query rows at any batch)" if version_of(V2_FROM_BATCH, rows - 1) == 3 else ""
    what += f" {kinds}"
    what += "" if ok2 else f"; v2 unavailable: {_first_line(why2)}"
    what += "" if ok3 else f"; v3 unavailable: {_first_line(why3)}"
    fns = {v: version_fn(v) for v, ok in ((1, True), (2, ok2), (3, ok3)) if ok}
    return DecodeKernel(_by_shape(fns, version_of), *cu.planners(version_of), what, True)


def _kernel_defines(version: int, split_q: bool, options: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The CUDA build of `version` the backend runs: with split Q, versions 2 and 3 read the latent and rope parts
    of Q where SGLang left them (design option MLA_SPLIT_Q); version 1 joins them (its Q pre-pass reads one row).
    options (SGLANG_H20_FP8_MLA_KERNEL_OPTIONS): more design options, for every version."""
    split = ("MLA_SPLIT_Q",) if split_q and version in (2, 3) else ()
    return split + tuple(o for o in options if o != "MLA_SPLIT_Q")


# ------------------------------------------------------------------------------------------------------------
# The feature: hooks, registration, selection
# ------------------------------------------------------------------------------------------------------------

def hooks(settings: Settings) -> list[Hook]:
    """Register the name with SGLang's registries, and patch: backend selection (launcher), the MLA pool
    class and its per-token size (schedulers)."""
    register()
    return [Hook(SELECT_TARGET, select_backend, "before"),
            Hook(POOL_TARGET, build_pool, "around"),
            Hook(CELL_TARGET, kv_cache_dim, "around")]


def add_backend_choice() -> None:
    """Make `--attention-backend h20_fp8_mla` parse. argparse holds SGLang's choices list by reference, so
    this works after the parser is built (the plugin calls it from its add_cli_args hook)."""
    from sglang.srt import server_args as sa

    if NAME not in sa.ATTENTION_BACKEND_CHOICES:
        sa.add_attention_backend_choices([NAME])


def register() -> None:
    """Through SGLang's own registration functions: the backend factory, DeepSeek's prefill dispatch for the
    name, chunked-prefix-cache support (our MHA prefill is FlashInfer's chunked one), the CLI choice."""
    from sglang.srt import server_args as sa
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    add_backend_choice()
    if NAME not in sa.CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS:
        sa.add_chunked_prefix_cache_attention_backend(NAME)
    register_attention_backend(NAME)(create_backend)
    importlib.import_module(HANDLER_MODULE).AttentionBackendRegistry.register(NAME, dispatch_deepseek)


def _named(server_args) -> bool:
    return NAME in (server_args.attention_backend, *(getattr(server_args, f, None) for f in SPLIT_FIELDS))


def request_from(server_args, environ=None) -> None:
    """Launcher, before features are decided: naming the backend switches the feature on, here and (through
    the environment) in the processes SGLang spawns."""
    if _named(server_args):
        (os.environ if environ is None else environ)[BY_NAME["fp8_mla"].env] = "on"


def fallback_if_off(server_args, decision) -> None:
    """Launcher: the feature did not turn on (its guards said why); a named h20_fp8_mla becomes SGLang's
    default backend, with one line, instead of failing later in the scheduler."""
    if decision.on or not _named(server_args):
        return
    log.info("fp8_mla: --attention-backend %s asked for, but the feature is off (%s): SGLang's default "
             "attention backend is used", NAME, decision.reason)
    for field in ("attention_backend", *SPLIT_FIELDS):
        if getattr(server_args, field, None) == NAME:
            setattr(server_args, field, None)


def model_problem(model_config) -> str | None:
    """Why this model cannot use the backend, or None. Shared by the launcher, the pool and the factory."""
    from sglang.srt.configs.model_config import AttentionArch, is_deepseek_dsa, is_deepseek_v4

    archs = list(getattr(model_config.hf_config, "architectures", None) or [])
    if model_config.attention_arch != AttentionArch.MLA:
        return f"the model ({', '.join(archs) or '?'}) does not use MLA"
    if is_deepseek_dsa(model_config.hf_config) or is_deepseek_v4(model_config.hf_config):
        return "the model uses DeepSeek sparse attention, which has its own KV format"
    if not any(a in DEEPSEEK_ARCHS for a in archs):
        return f"the model ({', '.join(archs) or '?'}) is not DeepSeek-V2/V3 (the dispatch this backend plugs into)"
    if (model_config.kv_lora_rank, model_config.qk_rope_head_dim) != (KV_LORA_RANK, ROPE_DIM):
        return (f"the MLA latent is {model_config.kv_lora_rank}+{model_config.qk_rope_head_dim}, the kernel's is "
                f"{KV_LORA_RANK}+{ROPE_DIM}")
    if model_config.dtype not in (torch.bfloat16, torch.float16):
        return f"the model dtype is {model_config.dtype} (bf16 or fp16 needed)"
    return None


def launch_problem(sa) -> str | None:
    """Why this launch cannot use the backend (model, then server arguments), or None."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase

    problem = model_problem(sa.get_model_config())
    if problem:
        return problem
    if sa.kv_cache_dtype not in ("auto", "fp8_e4m3"):
        return f"--kv-cache-dtype {sa.kv_cache_dtype} was asked for (this backend stores its own FP8 format)"
    if sa.speculative_algorithm:
        return f"speculative decoding ({sa.speculative_algorithm}) is not supported (no verify/draft path)"
    if getattr(sa, "dcp_size", 1) > 1 or getattr(sa, "enable_prefill_cp", False):
        return "context parallelism is not supported"
    if getattr(sa, "disaggregation_mode", "null") != "null":
        return "PD disaggregation is not supported (the KV transfer would miss the scales)"
    if getattr(sa, "enable_hierarchical_cache", False):
        return "the hierarchical cache is not supported (host copies would miss the scales)"
    cg = getattr(sa, "cuda_graph_config", None)
    if (cg is not None and (Phase.PREFILL, "backend") in getattr(sa, "_cuda_graph_config_locked", set())
            and cg.prefill.backend != Backend.DISABLED):
        return f"a captured prefill ({cg.prefill.backend}) was asked for (prefill here is eager)"
    return None


def plan_selection(sa) -> tuple[dict, str]:
    """(declarations for SGLang's resolution pipeline, the one log line) for this launch; see the module
    docstring for the precedence. Reads the user's own backend fields, not model defaults declared so far."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    user = sa.attention_backend
    split = tuple(getattr(sa, f, None) for f in SPLIT_FIELDS)
    if NAME in split:
        raise ValueError(f"{NAME} owns the KV cache format, so it serves prefill and decode: use --attention-backend "
                         f"{NAME} and leave --prefill-attention-backend/--decode-attention-backend unset")
    if user == NAME:
        why = f"--attention-backend {NAME}"
    elif user in (None, "flashmla") and split == (None, None):
        why = f"SGLANG_H20_FP8_MLA=on and --attention-backend {user or 'unset'}"
    else:
        chosen = user if split == (None, None) else f"{user} (prefill {split[0]}, decode {split[1]})"
        return {}, (f"fp8_mla: keeping the explicitly chosen attention backend {chosen}; SGLANG_H20_FP8_MLA "
                    f"replaces only an unset or flashmla backend")
    problem = launch_problem(sa)
    if problem:
        if user == NAME and sa.speculative_algorithm:
            raise ValueError(f"--attention-backend {NAME}: {problem}; drop --speculative-algorithm or use flashmla")
        fallback = None if user == NAME else user
        return ({"attention_backend": None} if user == NAME else {}), (
            f"fp8_mla: {why}, but {problem}: {fallback or 'SGLang default'} attention backend (upstream behaviour)")
    notes = ""
    if sa.page_size not in (None, PAGE_SIZE):
        notes += f", page size {sa.page_size} -> {PAGE_SIZE}"
    cg = getattr(sa, "cuda_graph_config", None)
    if cg is not None and cg.prefill.backend != Backend.DISABLED:
        cg.prefill.backend = Backend.DISABLED  # as upstream does for trtllm_mla; prefill here is eager
        notes += ", prefill CUDA graph off"
    decl = {"attention_backend": NAME, "page_size": PAGE_SIZE, "kv_cache_dtype": "fp8_e4m3"}
    return decl, (f"fp8_mla: attention backend {NAME} ({why}): FP8 latent KV cache, {_kernel().KV_BYTES_PER_TOKEN} "
                  f"B/token/layer (BF16: {2 * HEAD_DIM_QK}), page size {PAGE_SIZE}{notes}")


def select_backend(server_args, *_args, **_kwargs):
    """BEFORE ServerArgs._handle_attention_backend_compatibility (launcher): declare this launch's backend,
    page size and KV dtype through SGLang's resolution pipeline, before it fills defaults and page sizes."""
    from sglang.srt.arg_groups.overrides import run_post_process_pass

    decl, line = plan_selection(server_args)
    log.info(line)

    def fp8_mla_selection(_view):
        return decl

    if decl:
        run_post_process_pass(server_args, fp8_mla_selection)


def build_pool(original, kvc, *, max_total_num_tokens):
    """AROUND KVCacheConfigurator._build_mla_kv_pool (scheduler): our FP8 pool for this backend."""
    if (kvc.server_args.attention_backend != NAME or getattr(kvc, "is_draft_worker", False)
            or model_problem(kvc.model_config)):
        return original(kvc, max_total_num_tokens=max_total_num_tokens)
    from sglang.srt.runtime_context import get_exec

    from sglang_h20.attention.fp8_kv_pool import FP8MLATokenToKVPool

    return FP8MLATokenToKVPool(
        max_total_num_tokens, page_size=kvc.pool_page_size, dtype=kvc.kv_cache_dtype,
        kv_lora_rank=kvc.model_config.kv_lora_rank, qk_rope_head_dim=kvc.model_config.qk_rope_head_dim,
        layer_num=kvc.layer_info.num_effective_layers, device=kvc.device,
        enable_memory_saver=get_exec().features.enable_memory_saver,
        start_layer=kvc.layer_info.start_layer, end_layer=kvc.layer_info.end_layer)


def kv_cache_dim(original, *, model_config, kv_cache_dtype, server_args):
    """AROUND calculate_mla_kv_cache_dim: SGLang sizes the pool as dim x element size x layers; at 1-byte
    elements, the kernel's KV_BYTES_PER_TOKEN makes that the real footprint (FP8 latent + scales)."""
    dim = original(model_config=model_config, kv_cache_dtype=kv_cache_dtype, server_args=server_args)
    if (server_args.attention_backend == NAME and torch._utils._element_size(kv_cache_dtype) == 1
            and model_problem(model_config) is None):
        return _kernel().KV_BYTES_PER_TOKEN
    return dim


def create_backend(runner):
    """Factory registered under NAME. Re-checks the model and the pool (defence in depth: the launcher has
    already checked); on a problem, one line and SGLang's triton backend."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    from sglang_h20.attention.fp8_kv_pool import FP8MLATokenToKVPool

    problem = model_problem(runner.model_config)
    if problem is None and not isinstance(runner.token_to_kv_pool, FP8MLATokenToKVPool):
        problem = f"the KV pool is {type(runner.token_to_kv_pool).__name__}, not the FP8 pool"
    if problem:
        log.warning("fp8_mla: %s: backend %s falls back to SGLang's triton backend", problem, NAME)
        return ATTENTION_BACKENDS["triton"](runner)
    backend = FP8MLABackend(runner)
    if backend.takes_q_rope and Settings.from_env()["fp8_mla_split_q"]:
        log.info("%s: %s", NAME, take_q_in_parts())
    return backend


ABSORB_CORE_LIST = "sglang.srt.models.deepseek_common.utils.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS"


def take_q_in_parts() -> str:
    """Put NAME on SGLang's list of the backends to which DeepSeek's absorbed attention hands Q and K as (latent,
    rope) parts (attn_mqa(q_nope_out, k_nope, k_nope, q_rope=q_pe, k_rope=k_pe)) instead of joining Q with torch.cat
    for them (~16 us per layer at batch 48 x 128 heads). Returns what happened, for the log line."""
    module, _, attr = ABSORB_CORE_LIST.rpartition(".")
    try:
        names = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        return f"Q stays joined: {ABSORB_CORE_LIST} not found ({type(e).__name__})"
    if not isinstance(names, list):
        return f"Q stays joined: {ABSORB_CORE_LIST} is a {type(names).__name__}, not a list"
    if NAME not in names:
        names.append(NAME)
    return "Q taken as SGLang's (latent, rope) parts, read in place by the kernel (SGLANG_H20_FP8_MLA_SPLIT_Q)"


def _join_parts(q, k, q_rope, k_rope, heads: int):
    """Q [tokens, heads, 576] and K [tokens, 1, 576] from SGLang's (latent, rope) parts, for the paths that read one
    tensor; a part that is None leaves its tensor as it came."""
    if q_rope is not None:
        q = torch.cat([q.reshape(-1, heads, KV_LORA_RANK), q_rope.reshape(-1, heads, ROPE_DIM).to(q.dtype)], -1)
    if k_rope is not None and k is not None:
        k = torch.cat([k.reshape(-1, 1, KV_LORA_RANK), k_rope.reshape(-1, 1, ROPE_DIM).to(k.dtype)], -1)
    return q, k


def _active_backend():
    from sglang.srt.layers.attention.tbo_backend import TboAttnBackend
    from sglang.srt.model_executor.forward_context import get_attn_backend

    backend = get_attn_backend()
    return backend.primary if isinstance(backend, TboAttnBackend) else backend


def dispatch_deepseek(attn, forward_batch):
    """DeepSeek's MHA/MLA choice for NAME: upstream's shared rule (and so the mha_mla policy's hook), except
    that MHA needs the FlashInfer prefill; without it, or with ragged MHA disabled, always MLA."""
    h = importlib.import_module(HANDLER_MODULE)
    backend = _active_backend()
    if not isinstance(backend, FP8MLABackend):  # the factory fell back to triton
        return h.handle_attention_triton(attn, forward_batch)
    if not backend.mha_prefill or attn.flashinfer_mla_disable_ragged:
        return h._dispatch_mla_subtype(attn, forward_batch)
    return h._handle_attention_backend(attn, forward_batch, NAME)


# ------------------------------------------------------------------------------------------------------------
# The backend
# ------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class DecodeMeta:
    block_table: torch.Tensor    # [bs, pages] int32
    cache_seqlens: torch.Tensor  # [bs] int32, the new token included
    plan: MLADecodeMetadata


@dataclasses.dataclass
class ExtendMeta:
    """The absorbed-MLA prefill's view of the batch: new tokens per request, and the cached prefix as slots."""
    qo_indptr: torch.Tensor   # [bs + 1] int32
    kv_indptr: torch.Tensor   # [bs + 1] int32, into the gathered prefix
    kv_indices: torch.Tensor  # [total_prefix] int64: 0..total-1 (the gathered prefix is contiguous)
    prefix_loc: torch.Tensor  # [total_prefix] int64 pool slots
    max_extend: int


def _kernel_flag(name: str) -> bool:
    try:
        from sglang.srt.runtime_context import get_exec

        return bool(getattr(get_exec().kernel, name))
    except Exception:  # no runtime context (unit tests)
        return False


def _make_prefill_backend(model_runner):
    """SGLang's FlashInfer MLA backend for MHA prefill (the one upstream flashmla inherits), or None."""
    from sglang.srt.utils import is_flashinfer_available

    if not is_flashinfer_available():
        log.warning("fp8_mla: flashinfer is not available: every prefill runs absorbed MLA (Triton extend kernel)")
        return None
    from sglang.srt.layers.attention.flashinfer_mla_backend import FlashInferMLAAttnBackend

    return FlashInferMLAAttnBackend(model_runner)


class FP8MLABackend(AttentionBackend):
    """Decode and absorbed-MLA prefill on the FP8 pool; MHA prefill through SGLang's FlashInfer MLA backend."""

    needs_cpu_seq_lens = False  # decode uses seq_lens_cpu only when present; prefill batches always carry it

    def __init__(self, model_runner, prefill_backend="auto", num_heads: int | None = None):
        super().__init__()
        self.mla = _kernel()
        assert (self.mla.KV_LORA_RANK, self.mla.HEAD_DIM_QK) == (KV_LORA_RANK, HEAD_DIM_QK)
        self._decode_fp8, self._plan_fn, self._splits_lut, what, self.takes_q_rope = decode_kernel()
        log.info("%s: decode kernel %s", NAME, what)
        mc = model_runner.model_config
        if num_heads is None:
            from sglang.srt.runtime_context import get_parallel

            num_heads = mc.num_attention_heads // get_parallel().attn_tp_size
        self.num_heads = num_heads
        self.max_context_len = mc.context_len
        self.device = model_runner.device
        # SGLang's forward context reaches the pools through the attention backend (get_token_to_kv_pool())
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.page_size = self.token_to_kv_pool.page_size
        if self.page_size != PAGE_SIZE:
            raise ValueError(f"{NAME} needs page size {PAGE_SIZE}, the pool has {self.page_size}")
        self.prefill = _make_prefill_backend(model_runner) if prefill_backend == "auto" else prefill_backend
        self.mha_prefill = self.prefill is not None and not _kernel_flag("flashinfer_mla_disable_ragged")
        self.decode: DecodeMeta | None = None
        self._extend: ExtendMeta | None = None
        self._graph_block_table: torch.Tensor | None = None
        self._graph_seqlens: torch.Tensor | None = None
        self._graph_plans: dict[int, tuple[MLADecodeMetadata, torch.Tensor | None]] = {}

    # ---- metadata ------------------------------------------------------------------------------------------

    def _plan(self, cache_seqlens: torch.Tensor, max_seqlen: int) -> MLADecodeMetadata:
        """The kernel's split plan for one query token per sequence; max_seqlen keeps it free of device syncs."""
        return self._plan_fn(cache_seqlens, self.num_heads, 1, max_seqlen=max_seqlen)

    def _block_table(self, req_pool_indices: torch.Tensor, num_pages: int, out: torch.Tensor | None = None):
        """Page ids [bs, num_pages] int32: req_to_token at every page start, divided by the page size. Entries
        past a sequence's end hold some valid page (the kernel stops at the length)."""
        cols = (torch.arange(num_pages, device=self.req_to_token.device) * self.page_size).clamp_(
            max=self.req_to_token.shape[1] - 1)
        pages = self.req_to_token[req_pool_indices.long().unsqueeze(1), cols.unsqueeze(0)] // self.page_size
        if out is None:
            return pages.to(torch.int32)
        return out.copy_(pages)

    def init_forward_metadata(self, forward_batch):
        """Eager path. Decode: block table, lengths and split plan (max length from the CPU copy when the batch
        has one, else the context length: no device sync). Prefill: FlashInfer's plan for batches without a
        cached prefix (MHA); the MLA form builds its own on first use."""
        self._extend = None
        mode = forward_batch.forward_mode
        if mode.is_decode_or_idle():
            bs = forward_batch.batch_size
            if bs == 0:
                self.decode = None
                return
            cpu = forward_batch.seq_lens_cpu
            max_len = int(cpu[:bs].max()) if cpu is not None else self.max_context_len
            seqlens = forward_batch.seq_lens[:bs].to(torch.int32)
            block_table = self._block_table(forward_batch.req_pool_indices[:bs], cdiv(max_len, self.page_size))
            self.decode = DecodeMeta(block_table, seqlens, self._plan(seqlens, max_len))
        elif mode.is_target_verify() or mode.is_draft_extend_v2():
            raise NotImplementedError(f"{NAME}: speculative decoding is not supported (refused at startup)")
        elif self.mha_prefill and not any(forward_batch.extend_prefix_lens_cpu):
            self.prefill.init_forward_metadata(forward_batch)

    def init_mha_chunk_metadata(self, forward_batch):
        """Called by DeepSeek's chunked-prefix MHA: FlashInfer plans its per-chunk ragged attention."""
        self.prefill.init_mha_chunk_metadata(forward_batch)

    def _extend_meta(self, forward_batch) -> ExtendMeta:
        bs = forward_batch.batch_size
        dev = self.req_to_token.device
        prefix_lens = forward_batch.extend_prefix_lens[:bs].to(torch.int32)
        total = int(sum(forward_batch.extend_prefix_lens_cpu))
        kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
        kv_indptr[1:] = torch.cumsum(prefix_lens, 0)
        qo_indptr = torch.zeros(bs + 1, dtype=torch.int32, device=dev)
        qo_indptr[1:] = torch.cumsum(forward_batch.extend_seq_lens[:bs], 0)
        row = torch.repeat_interleave(torch.arange(bs, device=dev), prefix_lens, output_size=total)
        col = torch.arange(total, device=dev) - kv_indptr[row]
        prefix_loc = self.req_to_token[forward_batch.req_pool_indices[row].long(), col].long()
        return ExtendMeta(qo_indptr, kv_indptr, torch.arange(total, device=dev), prefix_loc,
                          int(max(forward_batch.extend_seq_lens_cpu)))

    # ---- CUDA graphs (decode) ------------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        pages = cdiv(self.max_context_len, self.page_size)
        self._graph_block_table = torch.zeros((max_bs, pages), dtype=torch.int32, device=self.device)
        self._graph_seqlens = torch.ones(max_bs, dtype=torch.int32, device=self.device)
        self._graph_plans = {}

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Outside the graph, before capture and before every replay: point the decode metadata at the static
        buffers and, once per batch size, plan the grid for the context length (its most splits). The per-step
        refresh is init_forward_metadata_in_graph, recorded in the graph: a replay costs the host nothing here."""
        if not forward_batch.forward_mode.is_decode_or_idle():
            raise NotImplementedError(f"{NAME}: only decode is captured (prefill runs eagerly)")
        bs = forward_batch.batch_size
        if bs not in self._graph_plans:
            self._graph_plans[bs] = self.mla.graph_metadata(self._plan_fn, self._splits_lut, bs, self.num_heads, 1,
                                                            self.max_context_len, self.page_size, self.device)
        self.decode = DecodeMeta(self._graph_block_table[:bs], self._graph_seqlens[:bs], self._graph_plans[bs][0])

    def init_forward_metadata_in_graph(self, forward_batch):
        """Recorded in the decode graph and replayed with it: the step's lengths and block table copied from the
        graph's static inputs, and the split count those lengths call for (the grid stays the capture's). Without
        the run-time count every replay of short sequences wrote and combined fp32 partials for dozens of splits
        (batch 16 at 4.3k tokens: 33 splits where 4 are best, ~96 MB of partials per layer)."""
        if not forward_batch.forward_mode.is_decode_or_idle():
            return
        bs = forward_batch.batch_size
        m = self.decode
        m.cache_seqlens.copy_(forward_batch.seq_lens[:bs])
        self._block_table(forward_batch.req_pool_indices[:bs], m.block_table.shape[1], out=m.block_table)
        lut = self._graph_plans[bs][1]
        if m.plan.splits_dev is not None:
            self.mla.set_splits(m.plan.splits_dev, lut, m.cache_seqlens, self.page_size)

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    # ---- forward -------------------------------------------------------------------------------------------

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None,
                       **kwargs):
        """q [B, heads, 576], or its latent part [B, heads, 512] with q_rope [B, heads, 64] (and K likewise) when
        SGLang hands the parts (take_q_in_parts)."""
        if layer.logit_cap:  # the kernel has no soft cap; DeepSeek's layers have none (0.0)
            raise NotImplementedError(f"{NAME}: attention logit soft-capping (logit_cap={layer.logit_cap}) is not "
                                      "supported by the FP8 decode kernel; use --attention-backend flashinfer")
        if k is not None and save_kv_cache:
            if k_rope is not None:
                self.token_to_kv_pool.set_mla_kv_buffer(layer, forward_batch.out_cache_loc, k, k_rope)
            else:
                self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        m = self.decode
        heads = layer.tp_q_head_num
        bs = m.cache_seqlens.shape[0]
        parts = {}
        if q_rope is not None and self.takes_q_rope:  # the kernel reads both parts where they are
            q = q.reshape(bs, 1, heads, KV_LORA_RANK)
            parts["q_rope"] = q_rope.reshape(bs, 1, heads, ROPE_DIM)
        else:
            q = _join_parts(q, None, q_rope, None, heads)[0].view(bs, 1, heads, HEAD_DIM_QK)
        o = self._decode_fp8(q, self.token_to_kv_pool.kv_cache(layer.layer_id), m.block_table, m.cache_seqlens,
                             layer.scaling, m.plan, **parts)
        return o.view(-1, heads * KV_LORA_RANK)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None,
                       **kwargs):
        mode = forward_batch.forward_mode
        if mode.is_target_verify() or mode.is_draft_extend_v2():
            raise NotImplementedError(f"{NAME}: speculative decoding is not supported (refused at startup)")
        if layer.head_dim == HEAD_DIM_QK and layer.tp_k_head_num == 1:
            if q_rope is not None or k_rope is not None:  # SGLang's parts (take_q_in_parts): one tensor each here
                q, k = _join_parts(q, k, q_rope, k_rope, layer.tp_q_head_num)
                v = None if k is None else k[..., :KV_LORA_RANK]
            return self._forward_extend_mla(q, k, v, layer, forward_batch, save_kv_cache)
        if self.prefill is None:
            raise RuntimeError(f"{NAME}: MHA prefill reached the backend without the FlashInfer prefill")
        # MHA over per-head K/V: the FlashInfer backend never touches the pool on this path
        return self.prefill.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    def _forward_extend_mla(self, q, k, v, layer, forward_batch, save_kv_cache):
        """Absorbed MLA prefill: new tokens in BF16 from k/v, the cached prefix gathered and dequantized."""
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd

        if k is not None and save_kv_cache:
            self.token_to_kv_pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v)
        if k is None:  # cross-layer KV sharing: the new tokens are in the pool already
            k = self.token_to_kv_pool.dequantize_tokens(layer.layer_id, forward_batch.out_cache_loc, q.dtype)
        if self._extend is None:
            self._extend = self._extend_meta(forward_batch)
        m = self._extend
        heads = layer.tp_q_head_num
        q = q.reshape(-1, heads, HEAD_DIM_QK)
        k = k.reshape(-1, 1, HEAD_DIM_QK)
        prefix = self.token_to_kv_pool.dequantize_tokens(layer.layer_id, m.prefix_loc, q.dtype)
        if prefix.shape[0] == 0:  # nothing cached: the kernel reads no prefix, but wants a real pointer
            prefix = q.new_zeros((1, 1, HEAD_DIM_QK))
        o = q.new_empty((q.shape[0], heads, KV_LORA_RANK))
        extend_attention_fwd(q, k.contiguous(), k[..., :KV_LORA_RANK].contiguous(), o, prefix,
                             prefix[..., :KV_LORA_RANK], m.qo_indptr, m.kv_indptr, m.kv_indices, None, True, None,
                             m.max_extend, 1.0, 1.0, sm_scale=layer.scaling, logit_cap=layer.logit_cap or 0.0)
        return o.view(-1, heads * KV_LORA_RANK)
