"""The h20_fp8_mla attention backend inside the installed SGLang 0.5.17: registration, selection, KV pool, decode.

Kernels run on the Triton interpreter without a GPU (conftest sets TRITON_INTERPRET). The decode path runs the real
FP8 kernel through the backend and the real FP8 pool (real SGLang pool base class and RadixAttention layers; the
ForwardBatch and ModelRunner are small stand-ins with the fields the backend reads). Error bounds, for
rel = ||out - ref||_F / ||ref||_F with DeepSeek-like latents (RMS-normalised rows sharing a channel profile, rope
on its own scale):
* against fp32 attention on the dequantized pool contents (what the backend wrote; only the kernel's Q and P
  roundings remain): <= 2e-2, the kernel's own bound against its reference;
* against fp32 attention on the original bf16 latents (adds the FP8 rounding of K/V): <= 4e-2.
SGLang's Triton extend kernel does not run on the interpreter, so the absorbed-MLA prefill test swaps it for a
float32 function of the same contract (the gpu-marked test runs the real one). Launcher behaviour (argparse, the
one log line, fallback) runs in fresh processes, since SGLang's plugin state is per process.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import math
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from sglang_h20 import compat
from sglang_h20.attention import fp8_mla_backend as fb
from sglang_h20.features import FEATURES, Decision, decide
from sglang_h20.settings import Settings

from repo_scripts import REPO

mla = importlib.import_module("sgl_kernel_ext.mla_decode")
DEVICE = "cpu" if mla._INTERPRETED else "cuda"
CLEAN_ENV = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_H20_") and k != "SGLANG_PLUGINS"}
PAGE = 64


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---- registration and hook targets -----------------------------------------------------------------------------

def test_feature_points_at_this_module_and_every_hook_target_resolves():
    feature = next(f for f in FEATURES if f.name == "fp8_mla")
    assert feature.module == fb.__name__
    hooks = feature.hooks(Settings.from_env({"SGLANG_H20_FP8_MLA": "on"}))
    assert {h.target for h in hooks} == {fb.SELECT_TARGET, fb.POOL_TARGET, fb.CELL_TARGET}
    for hook in hooks:
        assert compat.check_target(hook.target) == (True, hook.target)


def test_decide_turns_it_on_with_a_hopper_gpu(monkeypatch):
    monkeypatch.setattr(compat, "check_gpu", lambda: (True, "NVIDIA H200 (sm_90, 140 GiB)"))
    feature = next(f for f in FEATURES if f.name == "fp8_mla")
    d = decide(feature, Settings.from_env({"SGLANG_H20_FP8_MLA": "on"}))
    assert d.on and d.reason == "on (SGLANG_H20_FP8_MLA=on; 3 hook(s))"
    old = "NVIDIA A100 (sm_80, 80 GiB) is older than sm_90 (Hopper)"
    monkeypatch.setattr(compat, "check_gpu", lambda: (False, old))
    d = decide(feature, Settings.from_env({"SGLANG_H20_FP8_MLA": "on"}))
    assert not d.on and "older than sm_90" in d.reason


def test_registration_makes_the_name_resolvable():
    from sglang.srt import server_args as sa
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry

    fb.register()
    fb.register()  # idempotent: one entry each
    assert ATTENTION_BACKENDS[fb.NAME] is fb.create_backend
    assert AttentionBackendRegistry.get_handler(fb.NAME) is fb.dispatch_deepseek
    assert sa.ATTENTION_BACKEND_CHOICES.count(fb.NAME) == 1
    assert sa.CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS.count(fb.NAME) == 1
    # the same lists SGLang's model runner and argparse read
    from sglang.srt.model_executor.model_runner_components import misc_utils

    assert fb.NAME in misc_utils.CHUNKED_PREFIX_CACHE_SUPPORTED_ATTENTION_BACKENDS
    import argparse

    parser = argparse.ArgumentParser()
    sa.ServerArgs.add_cli_args(parser)
    assert parser.parse_args(["--model-path", "m", "--attention-backend", fb.NAME]).attention_backend == fb.NAME


# ---- launcher: precedence and fallback -------------------------------------------------------------------------

def deepseek_config(**kw):
    from sglang.srt.configs.model_config import AttentionArch

    cfg = dict(attention_arch=AttentionArch.MLA, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16,
               hf_config=SimpleNamespace(architectures=["DeepseekV3ForCausalLM"]), context_len=512)
    cfg.update(kw)
    return SimpleNamespace(**cfg)


def server_args(model=None, **kw):
    from sglang.srt.model_executor.cuda_graph_config import CudaGraphConfig

    args = dict(attention_backend=None, prefill_attention_backend=None, decode_attention_backend=None,
                kv_cache_dtype="auto", speculative_algorithm=None, page_size=None, dcp_size=1,
                disaggregation_mode="null", enable_hierarchical_cache=False, cuda_graph_config=CudaGraphConfig(),
                _cuda_graph_config_locked=set())
    args.update(kw)
    model = model or deepseek_config()
    return SimpleNamespace(get_model_config=lambda: model, **args)


@pytest.mark.parametrize("user", [fb.NAME, None, "flashmla"])
def test_selection_takes_an_unset_flashmla_or_named_backend(user):
    sa = server_args(attention_backend=user, page_size=16)
    decl, line = fb.plan_selection(sa)
    assert decl == {"attention_backend": fb.NAME, "page_size": 64, "kv_cache_dtype": "fp8_e4m3"}
    assert line.startswith(f"fp8_mla: attention backend {fb.NAME} (")
    assert f"{mla.KV_BYTES_PER_TOKEN} B/token/layer (BF16: 1152)" in line and "page size 16 -> 64" in line  # 576 x 2
    assert sa.cuda_graph_config.prefill.backend == "disabled"  # prefill runs eagerly


def test_a_captured_prefill_the_user_locked_keeps_upstream():
    """A prefill CUDA graph the user set explicitly (locked) is refused with its name; the default one, or a locked
    'disabled', is switched off or kept off and the backend is selected."""
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase

    locked = {(Phase.PREFILL, "backend")}
    sa = server_args(attention_backend="flashmla", _cuda_graph_config_locked=locked)
    decl, line = fb.plan_selection(sa)
    assert decl == {} and f"a captured prefill ({sa.cuda_graph_config.prefill.backend}) was asked for" in line
    default = server_args(attention_backend="flashmla")  # the default prefill graph: switched off
    locked_off = server_args(attention_backend="flashmla", _cuda_graph_config_locked=locked)
    locked_off.cuda_graph_config.prefill.backend = Backend.DISABLED  # locked, to 'disabled': kept off
    for sa in (default, locked_off):
        decl, line = fb.plan_selection(sa)
        assert decl["attention_backend"] == fb.NAME and sa.cuda_graph_config.prefill.backend == Backend.DISABLED


def test_selection_keeps_an_explicit_other_backend():
    """The line names what the user chose: the one backend, or the prefill / decode pair."""
    for sa, chosen in ((server_args(attention_backend="fa3"), "backend fa3;"),
                       (server_args(prefill_attention_backend="fa3"), "(prefill fa3, decode None);")):
        decl, line = fb.plan_selection(sa)
        assert decl == {} and "keeping the explicitly chosen attention backend" in line and chosen in line, line


@pytest.mark.parametrize("kw, model, problem", [
    (dict(kv_cache_dtype="bf16"), None, "--kv-cache-dtype bf16 was asked for"),
    (dict(speculative_algorithm="EAGLE"), None, "speculative decoding (EAGLE) is not supported"),
    (dict(dcp_size=2), None, "context parallelism"),
    (dict(disaggregation_mode="decode"), None, "PD disaggregation"),
    ({}, dict(attention_arch="MHA", hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"])),
     "the model (LlamaForCausalLM) does not use MLA"),
    ({}, dict(hf_config=SimpleNamespace(architectures=["MiniCPM3ForCausalLM"])),
     "the model (MiniCPM3ForCausalLM) is not DeepSeek-V2/V3"),
    ({}, dict(kv_lora_rank=256), "the MLA latent is 256+64"),
    ({}, dict(dtype=torch.float32), "the model dtype is torch.float32"),
])
def test_unsupported_launches_keep_upstream_behaviour(kw, model, problem):
    from sglang.srt.configs.model_config import AttentionArch

    if model and model.get("attention_arch") == "MHA":
        model["attention_arch"] = AttentionArch.MHA
    # through the env switch: the user's backend stays, one line says why
    decl, line = fb.plan_selection(server_args(deepseek_config(**(model or {})), attention_backend="flashmla", **kw))
    assert decl == {} and problem in line and line.endswith("flashmla attention backend (upstream behaviour)")
    # named explicitly: SGLang's default instead (speculative decoding is an error, see below)
    if "speculative_algorithm" not in kw:
        decl, line = fb.plan_selection(server_args(deepseek_config(**(model or {})), attention_backend=fb.NAME, **kw))
        assert decl == {"attention_backend": None} and problem in line and "SGLang default" in line


def test_speculative_decoding_and_split_backends_are_refused_at_startup():
    with pytest.raises(ValueError, match="speculative decoding .* is not supported"):
        fb.plan_selection(server_args(attention_backend=fb.NAME, speculative_algorithm="EAGLE"))
    with pytest.raises(ValueError, match="serves prefill and decode"):
        fb.plan_selection(server_args(decode_attention_backend=fb.NAME))


def test_fallback_when_the_feature_is_off_logs_one_line(caplog):
    sa = SimpleNamespace(attention_backend=fb.NAME, prefill_attention_backend=None, decode_attention_backend=None)
    with caplog.at_level(logging.INFO, logger="sglang_h20"):
        fb.fallback_if_off(sa, Decision(True, "on"))
        assert sa.attention_backend == fb.NAME and not caplog.records
        fb.fallback_if_off(sa, Decision(False, "SGLANG_H20_FP8_MLA=on asked for it, but no CUDA GPU visible"))
    assert sa.attention_backend is None
    assert [r.getMessage() for r in caplog.records] == [
        f"fp8_mla: --attention-backend {fb.NAME} asked for, but the feature is off (SGLANG_H20_FP8_MLA=on asked for "
        "it, but no CUDA GPU visible): SGLang's default attention backend is used"]
    env = {}
    fb.request_from(SimpleNamespace(attention_backend=fb.NAME, prefill_attention_backend=None,
                                    decode_attention_backend=None), env)
    assert env == {"SGLANG_H20_FP8_MLA": "on"}


def test_factory_falls_back_to_triton_for_another_model_or_pool(monkeypatch, caplog):
    from sglang.srt.layers.attention import attention_registry as reg

    monkeypatch.setitem(reg.ATTENTION_BACKENDS, "triton", lambda runner: ("triton", runner))
    runner = SimpleNamespace(model_config=deepseek_config(kv_lora_rank=256), token_to_kv_pool=None)
    with caplog.at_level(logging.WARNING, logger="sglang_h20"):
        assert fb.create_backend(runner) == ("triton", runner)
    assert len(caplog.records) == 1 and "falls back to SGLang's triton backend" in caplog.records[0].getMessage()
    assert "the MLA latent is 256+64" in caplog.records[0].getMessage()  # the model's problem named, not the pool's
    # the model fits but the pool is not ours (a launcher check skipped): the same fallback, naming the pool
    caplog.clear()
    runner = SimpleNamespace(model_config=deepseek_config(), token_to_kv_pool=SimpleNamespace())
    with caplog.at_level(logging.WARNING, logger="sglang_h20"):
        assert fb.create_backend(runner) == ("triton", runner)
    assert [r.getMessage() for r in caplog.records] == [
        f"fp8_mla: the KV pool is SimpleNamespace, not the FP8 pool: backend {fb.NAME} falls back to SGLang's triton "
        "backend"]


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """`prepare_server_args` with the plugin loaded and --attention-backend h20_fp8_mla, in two fresh processes run
    side by side: as on this machine (no GPU), and with the GPU guard answering as on an H200."""
    root = tmp_path_factory.mktemp("launch")
    subprocess.run([sys.executable, "scripts/make_model.py", str(root), "--models", "dsv3-4l"], check=True,
                   cwd=REPO, capture_output=True, timeout=300)
    procs = {}
    for name, hopper in (("cpu", False), ("hopper", True)):
        script = root / f"{name}.py"
        script.write_text(textwrap.dedent(LAUNCH.format(hopper=hopper, model=root / "dsv3-4l",
                                                        flags=["--attention-backend", fb.NAME])))
        procs[name] = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env=CLEAN_ENV)
    done = {}
    for name, p in procs.items():
        out, err = p.communicate(timeout=300)
        done[name] = SimpleNamespace(returncode=p.returncode, stdout=out, stderr=err)
    return done


LAUNCH = """
    if {hopper}:  # what decide() sees on an H200
        from sglang_h20 import compat
        compat.check_gpu = lambda: (True, "NVIDIA H200 (sm_90, 140 GiB)")
    from sglang.srt.plugins import load_plugins
    load_plugins()
    from sglang.srt.server_args import prepare_server_args
    a = prepare_server_args(["--model-path", "{model}", "--device", "cpu", "--load-format", "dummy", *{flags}])
    print("RESULT", a.attention_backend, a.page_size, a.kv_cache_dtype)
"""


def plugin_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "[sglang-h20" in ln and "fp8_mla:" in ln]


def test_launcher_accepts_the_name_and_falls_back_without_a_gpu(launches):
    r = launches["cpu"]
    assert r.returncode == 0, r.stderr[-3000:]
    result = r.stdout.split("RESULT ", 1)[1].split()
    assert result[0] != fb.NAME and result[2] == "auto"  # SGLang's own choice for this device
    lines = plugin_lines(r.stderr)
    assert len(lines) == 2, lines  # the feature's decision, then the fallback
    assert "asked for, but the feature is off" in lines[1] and "no CUDA GPU visible" in lines[1]


def test_launcher_selects_it_on_hopper(launches):
    r = launches["hopper"]
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split("RESULT ", 1)[1].split() == [fb.NAME, "64", "fp8_e4m3"]
    lines = plugin_lines(r.stderr)
    assert len(lines) == 2, lines
    assert lines[0].endswith("fp8_mla: on (SGLANG_H20_FP8_MLA=on; 3 hook(s))")
    assert f"fp8_mla: attention backend {fb.NAME} (--attention-backend {fb.NAME})" in lines[1]


# ---- pool sizing hooks -----------------------------------------------------------------------------------------

def test_pool_size_per_token_is_the_fp8_format():
    calls = []

    def original(**kw):
        calls.append(kw)
        return 576

    ours = SimpleNamespace(attention_backend=fb.NAME)
    assert fb.kv_cache_dim(original, model_config=deepseek_config(), kv_cache_dtype=torch.float8_e4m3fn,
                           server_args=ours) == mla.KV_BYTES_PER_TOKEN == 576 + 4 * mla.NUM_KV_SCALES
    assert fb.kv_cache_dim(original, model_config=deepseek_config(), kv_cache_dtype=torch.float8_e4m3fn,
                           server_args=SimpleNamespace(attention_backend="flashmla")) == 576
    assert len(calls) == 2


def test_pool_hook_builds_the_fp8_pool_only_for_this_backend(monkeypatch):
    import sglang.srt.runtime_context as rc

    from sglang_h20.attention.fp8_kv_pool import FP8MLATokenToKVPool

    monkeypatch.setattr(rc, "get_exec", lambda: SimpleNamespace(features=SimpleNamespace(enable_memory_saver=False)))
    kvc = SimpleNamespace(server_args=SimpleNamespace(attention_backend=fb.NAME), model_config=deepseek_config(),
                          pool_page_size=PAGE, kv_cache_dtype=torch.float8_e4m3fn, device="cpu", is_draft_worker=False,
                          layer_info=SimpleNamespace(num_effective_layers=2, start_layer=0, end_layer=2))
    pool = fb.build_pool(lambda *a, **k: "upstream", kvc, max_total_num_tokens=4 * PAGE)
    assert isinstance(pool, FP8MLATokenToKVPool) and pool.layer_num == 2
    kvc.server_args.attention_backend = "flashmla"
    assert fb.build_pool(lambda *a, **k: "upstream", kvc, max_total_num_tokens=4 * PAGE) == "upstream"


# ---- the pool ----------------------------------------------------------------------------------------------------

def make_pool(pages=8, layers=2, **kw):
    """DeepSeek's FP8 pool of `pages` pages; kw overrides any constructor argument (size, dtype, start_layer, ...)."""
    from sglang_h20.attention.fp8_kv_pool import FP8MLATokenToKVPool

    return FP8MLATokenToKVPool(**{**dict(size=pages * PAGE, page_size=PAGE, dtype=torch.float8_e4m3fn,
                                         kv_lora_rank=512, qk_rope_head_dim=64, layer_num=layers, device=DEVICE,
                                         enable_memory_saver=False), **kw})


def deepseek_latent(n, gen, mu) -> torch.Tensor:
    """[n, 1, 576] bf16 like DeepSeek's cache: RMS-normalised latent with a shared profile, rope on its own scale."""
    z = torch.randn(n, 512, generator=gen) + mu
    z = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + 1e-6)
    return torch.cat([z, 2.0 * torch.randn(n, 64, generator=gen)], -1).unsqueeze(1).bfloat16().to(DEVICE)


def layer(layer_id=1, heads=16):
    from sglang.srt.layers.radix_attention import RadixAttention

    return RadixAttention(heads, 576, 1 / math.sqrt(192), 1, layer_id, v_head_dim=512)


def test_pool_layout_bytes_and_writes_touch_only_their_slots():
    pool = make_pool(pages=4, layers=2)
    slots = (4 + 1) * PAGE  # the padded page included
    assert pool.get_kv_size_bytes() == 2 * slots * mla.KV_BYTES_PER_TOKEN
    kv, scales = pool.kv_cache(1)
    assert kv.shape == (5, PAGE, 576) and kv.dtype == torch.float8_e4m3fn and kv.is_contiguous()
    assert scales.shape == (5, PAGE, mla.NUM_KV_SCALES) and scales.dtype == torch.float32
    for buf in (*pool.kv_buffer, *pool.kv_scale_buffer):
        buf.view(torch.uint8).fill_(0x7F)  # NaN everywhere: any write outside loc would show
    gen = torch.Generator().manual_seed(0)
    latent = deepseek_latent(10, gen, torch.randn(512, generator=gen))
    loc = torch.tensor([3, 64, 65, 100, 127, 128, 200, 255, 256, 300], device=DEVICE)
    lyr = layer(1)
    pool.set_kv_buffer(lyr, loc[:5], latent[:5], latent[:5, :, :512])
    pool.set_mla_kv_buffer(lyr, loc[5:], latent[5:, :, :512], latent[5:, :, 512:])
    back = pool.dequantize_tokens(1, loc, torch.float32)
    assert back.shape == (10, 1, 576)
    assert rel(back, latent) <= 3.5e-2  # e4m3 keeps 3 mantissa bits: ~2.7% rms per element
    q8, s = mla.quantize_kv_fp8(latent[:, 0])
    assert torch.equal(pool.kv_buffer[1].view(-1, 576)[loc], q8.view(torch.uint8))
    untouched = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    untouched[loc] = False
    assert (pool.kv_buffer[1].view(-1, 576)[untouched] == 0x7F).all()
    assert (pool.kv_buffer[0].view(-1, 576) == 0x7F).all()  # the other layer
    nope, rope = pool.get_mla_kv_buffer(lyr, loc, torch.bfloat16)
    assert nope.shape == (10, 1, 512) and rope.shape == (10, 1, 64) and nope.dtype == torch.bfloat16
    assert nope.is_contiguous() and rope.is_contiguous()  # kv_b_proj reads k_nope
    assert torch.equal(torch.cat([nope, rope], -1), back.bfloat16())
    pool.move_kv_cache(torch.tensor([5], device=DEVICE), loc[:1])
    assert torch.equal(pool.dequantize_tokens(1, torch.tensor([5], device=DEVICE), torch.float32), back[:1])
    assert pool.get_mla_kv_buffer(lyr, loc[:2])[0].dtype == torch.bfloat16  # upstream's default


@pytest.mark.parametrize("kw, bad", [
    (dict(dtype=torch.bfloat16), "got torch.bfloat16"),  # the format alone wrong
    (dict(qk_rope_head_dim=32), "dim=544"),             # the latent's width alone
    (dict(kv_lora_rank=448, qk_rope_head_dim=128), "kv_lora_rank=448"),  # 576 wide, but not 512 + 64
    (dict(size=PAGE + 1), "whole number"),              # a pool of a page and one token
])
def test_pool_refuses_each_wrong_layout_alone(kw, bad):
    with pytest.raises(ValueError, match=bad):
        make_pool(pages=4, layers=1, **kw)


def test_pool_of_a_later_pipeline_stage_indexes_its_own_layers():
    """Under pipeline parallelism a pool holds layers start_layer.. only: layer ids map to its buffers by offset."""
    pool = make_pool(pages=2, layers=2, start_layer=5, end_layer=7)
    gen = torch.Generator().manual_seed(1)
    latent = deepseek_latent(3, gen, torch.randn(512, generator=gen))
    loc = torch.tensor([1, 70, 100], device=DEVICE)
    pool.set_kv_buffer(layer(6), loc, latent, latent[:, :, :512])
    assert pool.kv_cache(6)[1].view(-1, mla.NUM_KV_SCALES)[loc].abs().sum() > 0  # its scales, not layer 5's
    assert pool.kv_scale_buffer[0].abs().sum() == 0
    assert rel(pool.dequantize_tokens(6, loc, torch.float32), latent) <= 3.5e-2


# ---- the backend: decode ---------------------------------------------------------------------------------------

class Batch:
    """A pool filled with the cached part of some requests, their pages shuffled as SGLang's allocator leaves them."""

    def __init__(self, lens, heads=16, seed=0, max_reqs=4, context=512, pages=16):
        self.gen = torch.Generator().manual_seed(seed)
        self.mu = torch.randn(512, generator=self.gen)
        self.pool = make_pool(pages=pages)
        self.req_to_token = torch.zeros(max_reqs, context, dtype=torch.int32, device=DEVICE)
        self.heads, self.lens = heads, list(lens)
        free = (torch.randperm(pages, generator=self.gen) + 1).tolist()  # page 0 is SGLang's padding page
        self.latent = []
        for r, n in enumerate(self.lens):
            pos = torch.arange(context)
            page_ids = torch.tensor([free.pop() for _ in range(triton_cdiv(n, PAGE))] or [0])
            row = page_ids[(pos // PAGE).clamp(max=len(page_ids) - 1)] * PAGE + pos % PAGE
            self.req_to_token[r] = row.int().to(DEVICE)
            self.latent.append(deepseek_latent(n, self.gen, self.mu))
        self.runner = SimpleNamespace(model_config=SimpleNamespace(context_len=context), device=DEVICE,
                                      req_to_token_pool=SimpleNamespace(req_to_token=self.req_to_token),
                                      token_to_kv_pool=self.pool)

    def slots(self, r, start, end):
        return self.req_to_token[r, start:end].long()

    def store(self, lyr, r, start, end):
        self.pool.set_kv_buffer(lyr, self.slots(r, start, end), self.latent[r][start:end], None)

    def backend(self, prefill=None):
        return fb.FP8MLABackend(self.runner, prefill_backend=prefill, num_heads=self.heads)


def triton_cdiv(a, b):
    return -(-a // b)


def attend(q, kv, scale, causal_offset=None, cap=0.0):
    """fp32 attention of q [T, H, 576] over kv [N, 576]; causal: query t sees keys < causal_offset + t + 1; cap > 0:
    scores soft-capped to cap * tanh(s / cap), as SGLang's kernels do."""
    s = torch.einsum("thd,nd->thn", q.float(), kv.float()) * scale
    if cap > 0:
        s = cap * torch.tanh(s / cap)
    if causal_offset is not None:
        t = torch.arange(q.shape[0], device=q.device)[:, None, None]
        s = s.masked_fill(torch.arange(kv.shape[0], device=q.device)[None, None, :] > causal_offset + t, float("-inf"))
    return torch.einsum("thn,nc->thc", s.softmax(-1), kv[:, :512].float())


def decode_batch(b):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    bs = len(b.lens)
    lens = torch.tensor(b.lens, device=DEVICE)
    return SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=bs,
                           req_pool_indices=torch.arange(bs, device=DEVICE),
                           seq_lens=lens, seq_lens_cpu=lens.cpu(),
                           out_cache_loc=torch.stack([b.slots(r, n - 1, n)[0] for r, n in enumerate(b.lens)]))


def check_decode(b, out, q, lyr):
    for r, n in enumerate(b.lens):
        got = out[r].view(b.heads, 512)
        cached = b.pool.dequantize_tokens(lyr.layer_id, b.slots(r, 0, n), torch.float32)[:, 0]
        want = attend(q[r:r + 1], cached, lyr.scaling)[0]
        exact = attend(q[r:r + 1], b.latent[r][:, 0], lyr.scaling)[0]
        assert torch.isfinite(got.float()).all()
        assert rel(got, want) <= 2e-2, (r, rel(got, want))
        assert rel(got, exact) <= 4e-2, (r, rel(got, exact))


def test_backend_exposes_the_pools_to_sglangs_forward_context():
    """SGLang's model code writes K/V through get_token_to_kv_pool() = the attention backend's token_to_kv_pool
    (seen failing on the H200 when the backend lacked it)."""
    from sglang.srt.model_executor import forward_context

    b = Batch([70], seed=3)
    backend = b.backend()
    assert backend.token_to_kv_pool is b.pool and backend.req_to_token_pool is b.runner.req_to_token_pool
    src = inspect.getsource(forward_context.get_token_to_kv_pool)
    assert "get_attn_backend().token_to_kv_pool" in src  # the contract this test stands for


def test_decode_writes_the_new_token_and_matches_fp32():
    b = Batch([70, 1, 129], heads=16, seed=1)  # across pages, length 1, one past two pages
    lyr = layer(1)
    for r, n in enumerate(b.lens):
        b.store(lyr, r, 0, n - 1)  # the cache before this step
    be = b.backend()
    fbatch = decode_batch(b)
    be.init_forward_metadata(fbatch)
    assert be.decode.block_table.dtype == torch.int32 and be.decode.block_table.shape == (3, 3)
    assert torch.equal(be.decode.block_table[:, 0], (b.req_to_token[:3, 0] // PAGE))
    assert be.decode.plan.num_row_blocks == 1
    q = torch.randn(3, 16, 576, generator=b.gen).bfloat16().to(DEVICE) * 0.5
    k = torch.cat([b.latent[r][n - 1:n] for r, n in enumerate(b.lens)])
    out = be.forward(q, k, k[..., :512], lyr, fbatch)
    assert out.shape == (3, 16 * 512) and out.dtype == torch.bfloat16
    check_decode(b, out, q, lyr)


def test_cuda_graph_metadata_lives_in_static_buffers():
    """Capture: out_graph points the metadata at the static buffers and plans the grid; in_graph (recorded in the
    graph) fills them from the graph's static inputs. Replay: the runner copies the step's inputs into those inputs,
    out_graph does no per-step work, and the recorded in_graph refreshes lengths, pages and split count."""
    b = Batch([41, 400], heads=16, seed=2)  # the lengths of the second step; the first step's are shorter
    lyr = layer(0)
    b.lens = [40, 100]
    for r, n in enumerate(b.lens):
        b.store(lyr, r, 0, n)
    be = b.backend()
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    fbatch = decode_batch(b)  # its tensors stand for the graph runner's static input buffers
    be.init_forward_metadata_out_graph(fbatch, in_capture=True)
    captured = be.decode
    assert captured.block_table.data_ptr() == be._graph_block_table.data_ptr()
    assert captured.cache_seqlens.data_ptr() == be._graph_seqlens.data_ptr()
    assert captured.block_table.shape == (2, 512 // PAGE)
    # the grid is planned at capture from the context bound; the split count it runs comes from the lengths
    bound = mla.get_mla_decode_metadata(torch.ones(2), 16, 1, max_seqlen=512)
    assert bound.num_splits == 4 and captured.plan.num_splits == 4
    assert captured.plan == dataclasses.replace(bound, splits_dev=captured.plan.splits_dev)
    be.init_forward_metadata_in_graph(fbatch)  # recorded in the graph at capture
    lut = mla.splits_lut(16, 1, 2, 512, PAGE)
    assert captured.plan.splits_dev.item() == lut[2].item() == 1  # 100 tokens: 2 pages, no split pays
    assert captured.cache_seqlens.tolist() == [40, 100]
    pages = b.req_to_token[:2, ::PAGE] // PAGE
    assert torch.equal(captured.block_table, pages.int())

    b.lens = [41, 400]  # the next step: one more token, and a second sequence long enough to split
    b.store(lyr, 0, 40, 41)
    b.store(lyr, 1, 100, 400)
    step = decode_batch(b)
    fbatch.seq_lens.copy_(step.seq_lens)  # what the runner does before a replay
    be.init_forward_metadata_out_graph(fbatch)
    assert be.decode.plan is captured.plan
    assert be.decode.cache_seqlens.tolist() == [40, 100]  # out_graph alone refreshes nothing: no host work
    be.init_forward_metadata_in_graph(fbatch)  # what the replay runs
    assert be.decode.block_table.data_ptr() == captured.block_table.data_ptr()
    assert be.decode.cache_seqlens.tolist() == [41, 400]
    assert be.decode.plan.splits_dev.item() == lut[7].item() > 1  # refreshed by every replay
    q = torch.randn(2, 16, 576, generator=b.gen).bfloat16().to(DEVICE) * 0.5
    k = torch.cat([b.latent[r][n - 1:n] for r, n in enumerate(b.lens)])
    out = be.forward_decode(q, k, k[..., :512], lyr, step)
    check_decode(b, out, q, lyr)
    assert be.get_cuda_graph_seq_len_fill_value() == 1


# ---- the backend: prefill ----------------------------------------------------------------------------------------

def extend_reference_kernel(q, k, v, o, k_buffer, v_buffer, qo_indptr, kv_indptr, kv_indices, custom_mask,
                            is_causal, mask_indptr, max_len_extend, k_scale, v_scale, sm_scale=None, logit_cap=0.0,
                            **_):
    """SGLang's extend_attention_fwd contract in float32: request b's queries see its prefix (k_buffer rows at
    kv_indices[kv_indptr[b]:kv_indptr[b+1]]) and, causally, its own new tokens."""
    assert custom_mask is None and is_causal and k.shape[1] == 1
    for bi in range(qo_indptr.numel() - 1):
        q0, q1 = int(qo_indptr[bi]), int(qo_indptr[bi + 1])
        pre = k_buffer[kv_indices[int(kv_indptr[bi]):int(kv_indptr[bi + 1])].long(), 0]
        assert torch.equal(v_buffer[kv_indices[int(kv_indptr[bi]):int(kv_indptr[bi + 1])].long(), 0], pre[:, :512])
        kv = torch.cat([pre, k[q0:q1, 0]]).float()
        assert torch.equal(v[q0:q1, 0], k[q0:q1, 0, :512])
        o[q0:q1] = attend(q[q0:q1], kv, sm_scale, causal_offset=pre.shape[0], cap=logit_cap).to(o.dtype)


def extend_batch(b, prefix, new):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    bs = len(prefix)
    out_loc = torch.cat([b.slots(r, p, p + e) for r, (p, e) in enumerate(zip(prefix, new))])
    return SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=bs,
                           req_pool_indices=torch.arange(bs, device=DEVICE),
                           seq_lens=torch.tensor([p + e for p, e in zip(prefix, new)], device=DEVICE),
                           extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32, device=DEVICE),
                           extend_prefix_lens_cpu=list(prefix), extend_seq_lens=torch.tensor(new, device=DEVICE),
                           extend_seq_lens_cpu=list(new), out_cache_loc=out_loc)


def check_mla_extend(b, be, prefix, new, lyr, parts=False, qscale=0.5):
    """Prefix cached; the backend stores the new tokens and attends over FP8 prefix + bf16 new tokens. parts: Q and
    K handed as SGLang's (latent, rope) parts, as to a backend on its absorb-core list."""
    for r, p in enumerate(prefix):
        b.store(lyr, r, 0, p)
    fbatch = extend_batch(b, prefix, new)
    be.init_forward_metadata(fbatch)
    T = sum(new)
    q = torch.randn(T, b.heads, 576, generator=b.gen).bfloat16().to(DEVICE) * qscale
    k = torch.cat([b.latent[r][p:p + e] for r, (p, e) in enumerate(zip(prefix, new))])
    cap = lyr.logit_cap or 0.0
    if parts:
        out = be.forward(q[..., :512], k[..., :512], k[..., :512], lyr, fbatch, q_rope=q[..., 512:],
                         k_rope=k[..., 512:]).view(T, b.heads, 512)
    else:
        out = be.forward(q, k, k[..., :512], lyr, fbatch).view(T, b.heads, 512)
    q0 = 0
    for r, (p, e) in enumerate(zip(prefix, new)):
        pre = b.pool.dequantize_tokens(lyr.layer_id, b.slots(r, 0, p), torch.bfloat16)[:, 0]
        want = attend(q[q0:q0 + e], torch.cat([pre, b.latent[r][p:p + e, 0]]), lyr.scaling, causal_offset=p, cap=cap)
        exact = attend(q[q0:q0 + e], b.latent[r][:p + e, 0], lyr.scaling, causal_offset=p, cap=cap)
        assert rel(out[q0:q0 + e], want) <= 1e-2, (r, rel(out[q0:q0 + e], want))  # bf16 output rounding
        assert rel(out[q0:q0 + e], exact) <= 4e-2
        # the new tokens went into the pool, quantized
        stored = b.pool.dequantize_tokens(lyr.layer_id, b.slots(r, p, p + e), torch.float32)
        assert rel(stored, b.latent[r][p:p + e]) <= 3.5e-2
        q0 += e


def test_mla_prefill_reads_the_dequantized_prefix(monkeypatch):
    import sglang.kernels.ops.attention.extend_attention as ext

    if DEVICE == "cpu":  # SGLang's Triton extend kernel does not run on the interpreter
        monkeypatch.setattr(ext, "extend_attention_fwd", extend_reference_kernel)
    b = Batch([75, 40, 9], heads=16, seed=3)
    check_mla_extend(b, b.backend(), prefix=[70, 0, 4], new=[5, 40, 5], lyr=layer(1))
    b = Batch([75, 40, 9], heads=16, seed=8)
    check_mla_extend(b, b.backend(), prefix=[70, 0, 4], new=[5, 40, 5], lyr=layer(1), parts=True)


def test_logit_cap_reaches_the_prefill_kernel_and_is_refused_by_decode(monkeypatch):
    """A layer with a soft cap: the MLA prefill hands it to SGLang's kernel (checked against a capped reference; at
    this q scale the uncapped output is 22% off it), and decode, whose kernel has none, refuses it."""
    import sglang.kernels.ops.attention.extend_attention as ext

    if DEVICE == "cpu":
        monkeypatch.setattr(ext, "extend_attention_fwd", extend_reference_kernel)
    lyr = layer(1)
    lyr.logit_cap = 2.0
    b = Batch([75, 40, 9], heads=16, seed=5)
    check_mla_extend(b, b.backend(), prefix=[70, 0, 4], new=[5, 40, 5], lyr=lyr, qscale=1.0)
    b = Batch([16, 9], heads=16, seed=6)
    be = b.backend()
    be.init_forward_metadata(decode_batch(b))
    q = torch.randn(2, 16, 576, device=DEVICE).bfloat16()
    with pytest.raises(NotImplementedError, match="logit_cap=2.0"):
        be.forward_decode(q, None, None, lyr, decode_batch(b))


class FakePrefill:
    """Stands in for SGLang's FlashInfer MLA backend: records what the backend hands it."""

    def __init__(self):
        self.calls = []

    def init_forward_metadata(self, fbatch):
        self.calls.append(("init", fbatch.batch_size))

    def init_mha_chunk_metadata(self, fbatch):
        self.calls.append(("chunk", fbatch.batch_size))

    def forward_extend(self, q, k, v, lyr, fbatch, save_kv_cache):
        self.calls.append(("forward", lyr.layer_id, save_kv_cache))
        return q.new_zeros(q.shape[0], lyr.tp_q_head_num * lyr.v_head_dim)


def test_mha_prefill_goes_to_flashinfer_and_never_reads_the_pool(monkeypatch):
    from sglang.srt.layers.radix_attention import RadixAttention

    b = Batch([32, 16], heads=16, seed=4)
    fake = FakePrefill()
    be = b.backend(prefill=fake)
    assert be.mha_prefill and not b.backend(prefill=None).mha_prefill  # no prefill backend: no MHA prefill
    mha = RadixAttention(16, 192, 1 / math.sqrt(192), 16, 2, v_head_dim=128)
    fbatch = extend_batch(b, [0, 0], [32, 16])
    be.init_forward_metadata(fbatch)  # no cached prefix: FlashInfer plans its ragged MHA
    q = torch.zeros(48, 16, 192, device=DEVICE)
    before = [t.clone() for t in (*b.pool.kv_buffer, *b.pool.kv_scale_buffer)]
    out = be.forward(q, q, q[..., :128], mha, fbatch, save_kv_cache=False)
    assert out.shape == (48, 16 * 128)
    assert fake.calls == [("init", 2), ("forward", 2, False)]
    assert all(torch.equal(x, y) for x, y in zip(before, (*b.pool.kv_buffer, *b.pool.kv_scale_buffer)))
    fake.calls.clear()
    be.init_forward_metadata(extend_batch(b, [16, 0], [16, 16]))  # a prefix: chunked MHA plans per chunk later
    be.init_mha_chunk_metadata(fbatch)
    assert fake.calls == [("chunk", 2)]


def test_auto_prefill_is_flashinfers_mla_backend_when_flashinfer_is_there(monkeypatch, caplog):
    """prefill_backend="auto": upstream's FlashInfer MLA backend on the same model runner when flashinfer imports,
    else none (every prefill absorbed MLA), said once in the log."""
    import sglang.srt.layers.attention.flashinfer_mla_backend as fimla
    import sglang.srt.utils as su

    monkeypatch.setattr(fimla, "FlashInferMLAAttnBackend", lambda runner: ("flashinfer", runner))
    runner = object()
    monkeypatch.setattr(su, "is_flashinfer_available", lambda: True)
    with caplog.at_level(logging.WARNING, logger=fb.log.name):
        assert fb._make_prefill_backend(runner) == ("flashinfer", runner)
    assert not caplog.records
    monkeypatch.setattr(su, "is_flashinfer_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger=fb.log.name):
        assert fb._make_prefill_backend(runner) is None
    assert [r.getMessage() for r in caplog.records] == [
        "fp8_mla: flashinfer is not available: every prefill runs absorbed MLA (Triton extend kernel)"]


def test_speculative_modes_are_refused_by_the_backend():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    be = Batch([8]).backend()
    with pytest.raises(NotImplementedError, match="speculative decoding"):
        be.init_forward_metadata(SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY))


# ---- DeepSeek's MHA/MLA dispatch ---------------------------------------------------------------------------------

def test_dispatch_is_upstreams_shared_rule_when_flashinfer_prefill_exists(monkeypatch):
    h = importlib.import_module(fb.HANDLER_MODULE)
    seen = []
    monkeypatch.setattr(h, "_handle_attention_backend", lambda attn, fbatch, name: seen.append(name) or "RULE")
    monkeypatch.setattr(h, "_dispatch_mla_subtype", lambda attn, fbatch: "MLA")
    monkeypatch.setattr(h, "handle_attention_triton", lambda attn, fbatch: "TRITON")
    attn = SimpleNamespace(flashinfer_mla_disable_ragged=False)
    be = Batch([8]).backend(prefill=FakePrefill())
    monkeypatch.setattr(fb, "_active_backend", lambda: be)
    assert fb.dispatch_deepseek(attn, None) == "RULE" and seen == [fb.NAME]  # the mha_mla policy wraps this
    attn.flashinfer_mla_disable_ragged = True
    assert fb.dispatch_deepseek(attn, None) == "MLA"
    attn.flashinfer_mla_disable_ragged = False
    be.mha_prefill = False  # no flashinfer: absorbed MLA for every prefill
    assert fb.dispatch_deepseek(attn, None) == "MLA"
    monkeypatch.setattr(fb, "_active_backend", lambda: object())  # the factory fell back to triton
    assert fb.dispatch_deepseek(attn, None) == "TRITON"


# ---- GPU: the same paths with the real kernels -------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_decode_and_mla_prefill_with_real_kernels():
    b = Batch([300, 1, 1000], heads=128, seed=5, context=1024, pages=40)
    lyr = layer(1, heads=128)
    for r, n in enumerate(b.lens):
        b.store(lyr, r, 0, n - 1)
    be = b.backend()
    fbatch = decode_batch(b)
    be.init_forward_metadata(fbatch)
    q = torch.randn(3, 128, 576, generator=b.gen).bfloat16().to(DEVICE) * 0.5
    k = torch.cat([b.latent[r][n - 1:n] for r, n in enumerate(b.lens)])
    check_decode(b, be.forward(q, k, k[..., :512], lyr, fbatch), q, lyr)
    b2 = Batch([200, 64, 90], heads=128, seed=6, context=1024, pages=40)
    check_mla_extend(b2, b2.backend(), prefix=[150, 0, 89], new=[50, 64, 1], lyr=layer(0, heads=128))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_decode_graph_replays_refresh_the_metadata_in_the_graph(heads):
    """What SGLang's decode graph runner does, with a real CUDA graph: out_graph before capture; in_graph and the
    decode recorded; before each replay the step's inputs copied into the graph's static inputs. Every replay must
    match the fp32 reference at its own lengths (pages, split count and the new token's slot included)."""
    final = [70, 900, 2]
    b = Batch(final, heads=heads, seed=7, context=1024, pages=40)
    full = list(b.latent)
    lyr = layer(0, heads=heads)
    be = b.backend()
    be.init_cuda_graph_state(max_bs=4, max_num_tokens=4)

    def step_inputs(lens, first):
        b.lens = list(lens)
        b.latent = [full[r][:n] for r, n in enumerate(lens)]
        for r, n in enumerate(lens):  # what earlier steps wrote; the step itself writes token n - 1
            if n - 1 > first[r]:
                b.store(lyr, r, first[r], n - 1)
        q = torch.randn(len(lens), heads, 576, generator=b.gen).bfloat16().to(DEVICE) * 0.5
        k = torch.cat([full[r][n - 1:n] for r, n in enumerate(lens)])
        return decode_batch(b), q, k

    fbatch, q, k = step_inputs([50, 500, 1], [0, 0, 0])  # fbatch, q, k: the graph's static inputs from here on
    be.init_forward_metadata_out_graph(fbatch, in_capture=True)

    def run():
        be.init_forward_metadata_in_graph(fbatch)
        return be.forward_decode(q, k, k[..., :512], lyr, fbatch)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()  # warm-up outside the graph, as the runner does
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    graph.replay()
    torch.cuda.synchronize()
    check_decode(b, out, q, lyr)
    splits_first = be.decode.plan.splits_dev.item() if be.decode.plan.splits_dev is not None else None

    nxt, q2, k2 = step_inputs(final, [49, 499, 0])
    for static, now in ((fbatch.seq_lens, nxt.seq_lens), (fbatch.out_cache_loc, nxt.out_cache_loc), (q, q2), (k, k2)):
        static.copy_(now)
    be.init_forward_metadata_out_graph(fbatch)
    graph.replay()
    torch.cuda.synchronize()
    check_decode(b, out, q, lyr)
    if splits_first is not None:  # 900 tokens want at least the splits of 500
        assert be.decode.plan.splits_dev.item() >= splits_first


@pytest.mark.gpu
@pytest.mark.parametrize("heads,batch", [(16, 3), (128, 16)])
def test_gpu_decode_reads_q_parts_in_place(heads, batch, monkeypatch):
    """SGLANG_H20_FP8_MLA_SPLIT_Q on a GPU: versions 3 (16 heads) and 2 (128 heads, batch 16) read SGLang's strided
    Q parts in place; the result equals the joined call's bit for bit and the fp32 reference within the bounds."""
    monkeypatch.setenv("SGLANG_H20_FP8_MLA_SPLIT_Q", "on")
    b = Batch([90 + 7 * r for r in range(batch)], heads=heads, seed=9, max_reqs=batch, context=256, pages=4 * batch)
    lyr = layer(0, heads=heads)
    for r, n in enumerate(b.lens):
        b.store(lyr, r, 0, n - 1)
    be = b.backend()
    assert be.takes_q_rope
    fbatch = decode_batch(b)
    be.init_forward_metadata(fbatch)
    q = torch.randn(batch, heads, 576, generator=b.gen).bfloat16().to(DEVICE) * 0.5
    k = torch.cat([b.latent[r][n - 1:n] for r, n in enumerate(b.lens)])
    q_nope = q[..., :512].transpose(0, 1).contiguous().transpose(0, 1)  # the absorbed bmm's layout
    out = be.forward_decode(q_nope, k[..., :512], k[..., :512], lyr, fbatch, q_rope=q[..., 512:], k_rope=k[..., 512:])
    joined = be.forward_decode(q, k, k[..., :512], lyr, fbatch)
    torch.cuda.synchronize()
    assert torch.equal(out, joined)
    check_decode(b, out, q, lyr)


def test_auto_decode_kernel_picks_the_version_by_shape(monkeypatch):
    """'auto' calls version 3 below V2_FROM_BATCH sequences and for at most V3_MAX_ROWS query rows, else version 2,
    passing every argument on; without v3, version 1 takes the small batches and the row count does not matter."""
    cu = importlib.import_module("sgl_kernel_ext.mla_decode_cuda")
    calls = []
    monkeypatch.setattr(cu, "available", lambda version=1, defines=(): (True, ""))
    monkeypatch.setattr(cu, "mla_decode_fp8_cuda", lambda q, *a, version=1, defines=(), **k: calls.append(
        (q.shape[0], version, a, k)) or version)
    fn = fb.decode_kernel("auto").fn
    cases = [(1, 1, 128, 3), (fb.V2_FROM_BATCH - 1, 2, 128, 3), (fb.V2_FROM_BATCH, 1, 128, 2), (128, 2, 128, 2),
             (1, 1, 16, 3), (128, 2, 16, 3), (128, 3, 16, 2), (64, 1, 32, 3), (64, 1, 33, 2), (1, 1, 64, 3)]
    for batch, q_len, heads, want in cases:
        assert fn(torch.empty(batch, q_len, heads, 576), "kv", "bt", "lens", 0.1, "plan", out="o") == want
    assert all(c[2] == ("kv", "bt", "lens", 0.1, "plan") and c[3] == {"out": "o"} for c in calls)
    monkeypatch.setattr(cu, "available", lambda version=1, defines=(): (version != 3, "" if version != 3 else "v3 failed"))
    k = fb.decode_kernel("auto")
    assert k.fn(torch.empty(1, 1, 16, 576), "kv", "bt", "lens", 0.1, "plan") == 1 and "v3 unavailable: v3 failed" in k.what
    assert k.fn(torch.empty(fb.V2_FROM_BATCH, 1, 16, 576), "kv", "bt", "lens", 0.1, "plan") == 2
    # v2 failing: version 1 from V2_FROM_BATCH above 32 rows (faster than v3 in 32-row CTAs at 16 of the 18 points
    # of 128 heads from batch 16 in session 49's grid), and `what` says so (it had said v3)
    monkeypatch.setattr(cu, "available",
                        lambda version=1, defines=(): (version != 2, "" if version != 2 else "v2 failed"))
    k = fb.decode_kernel("auto")
    assert k.what.startswith(f"CUDA v3 below batch {fb.V2_FROM_BATCH}, v1 from there") and "v2 failed" in k.what
    assert k.fn(torch.empty(fb.V2_FROM_BATCH, 1, 128, 576), "kv", "bt", "lens", 0.1, "plan") == 1
    assert k.fn(torch.empty(fb.V2_FROM_BATCH, 1, 16, 576), "kv", "bt", "lens", 0.1, "plan") == 3


def test_auto_plans_for_the_ctas_of_the_version_it_calls(monkeypatch):
    """'auto' plans each call for its version's CTAs: version 3 at 128 heads below V2_FROM_BATCH sequences runs four
    32-row CTAs per sequence (a plan for two of 64 would count half its CTAs per split); version 2 from there two of
    64; 16 heads one of 16. The split table of a CUDA-graph batch size agrees with the planner."""
    cu = importlib.import_module("sgl_kernel_ext.mla_decode_cuda")
    monkeypatch.setattr(cu, "available", lambda version=1, defines=(): (True, ""))
    k = fb.decode_kernel("auto")
    assert k.what.startswith(f"CUDA v3 below batch {fb.V2_FROM_BATCH}, v2 from there "
                             "(v3 for <= 32 query rows at any batch)")
    for batch, heads, block_h, row_blocks in ((1, 128, 32, 4), (fb.V2_FROM_BATCH - 1, 128, 32, 4),
                                              (fb.V2_FROM_BATCH, 128, 64, 2), (64, 16, 16, 1)):
        lens = torch.full((batch,), 4096, dtype=torch.int32)
        meta = k.plan(lens, heads, 1, num_sm=132, max_seqlen=4096)
        assert (meta.block_h, meta.num_row_blocks) == (block_h, row_blocks)
        assert meta == cu.get_mla_decode_metadata(lens, heads, 1, 132, max_seqlen=4096, rows_per_cta=block_h)
        assert torch.equal(k.splits_lut(heads, 1, batch, 16384, num_sm=132),
                           cu.splits_lut(heads, 1, batch, 16384, num_sm=132, rows_per_cta=block_h))
    # 128 heads at batch 1 x 16k: the 32-row plan differs from the 64-row one v1 / v2 would get
    one = torch.full((1,), 16384, dtype=torch.int32)
    assert k.plan(one, 128, 1, num_sm=132, max_seqlen=16384).num_splits != \
        cu.get_mla_decode_metadata(one, 128, 1, 132, max_seqlen=16384).num_splits


def test_decode_kernel_falls_back_to_triton_with_the_reason(monkeypatch):
    """The CUDA kernel where it can run, else the Triton one, with why (here: no CUDA device, or a failed build)."""
    mla = importlib.import_module("sgl_kernel_ext.mla_decode")
    cu = importlib.import_module("sgl_kernel_ext.mla_decode_cuda")
    fn, plan, lut, what, _ = fb.decode_kernel()
    if not torch.cuda.is_available():
        assert fn is mla.mla_decode_fp8 and what.startswith("Triton") and "no CUDA device" in what
    monkeypatch.setattr(cu, "available", lambda version=1, defines=(): (False, "build/load failed: nvcc not found\nmore"))
    fn, plan, lut, what, _ = fb.decode_kernel()
    assert fn is mla.mla_decode_fp8 and plan is mla.get_mla_decode_metadata and lut is mla.splits_lut
    assert "nvcc not found" in what and "more" not in what
    monkeypatch.setattr(cu, "available", lambda version=1, defines=(): (True, ""))
    fn, plan, lut, what, _ = fb.decode_kernel("cuda")
    assert fn is cu.mla_decode_fp8_cuda and plan is cu.get_mla_decode_metadata and what.startswith("CUDA (")
    assert lut is cu.splits_lut
    fn, plan, lut, what, _ = fb.decode_kernel()  # auto: the versions, by shape, each planned for its CTAs
    assert plan is not cu.get_mla_decode_metadata and what.startswith(f"CUDA v3 below batch {fb.V2_FROM_BATCH}, v2 from there")
    monkeypatch.setattr(cu, "available", lambda version=1, defines=(): (version == 1, "" if version == 1 else "v2 failed\nx"))
    fn, plan, lut, what, _ = fb.decode_kernel()  # auto without v2: v1, and why
    assert fn is cu.mla_decode_fp8_cuda and "v2 unavailable: v2 failed" in what and "x" not in what.split(": ")[-1]
    monkeypatch.setattr(cu, "available", lambda version=1, defines=(): (True, ""))
    fn, plan, lut, what, _ = fb.decode_kernel("cuda-v2")
    assert fn.func is cu.mla_decode_fp8_cuda and fn.keywords == {"version": 2, "defines": ("MLA_SPLIT_Q",)}  # default
    assert what.startswith("CUDA v2")
    lens = torch.full((16,), 4096, dtype=torch.int32)
    assert plan(lens, 128, 1, 132, max_seqlen=4096) == cu.get_mla_decode_metadata(lens, 128, 1, 132, max_seqlen=4096)
    fn, plan, lut, what, _ = fb.decode_kernel("cuda-v3")
    assert fn.func is cu.mla_decode_fp8_cuda and fn.keywords == {"version": 3, "defines": ("MLA_SPLIT_Q",)}
    assert what.startswith("CUDA v3")
    # 128 heads: 4 CTAs of 32 rows per sequence and split, planner and split table alike
    assert plan(lens, 128, 1, 132, max_seqlen=4096) == \
        cu.get_mla_decode_metadata(lens, 128, 1, 132, max_seqlen=4096, rows_per_cta=32)
    assert torch.equal(lut(128, 1, 16, 4096, num_sm=132), cu.splits_lut(128, 1, 16, 4096, num_sm=132, rows_per_cta=32))
    monkeypatch.setenv("SGLANG_H20_FP8_MLA_KERNEL", "triton")  # the switch, read when no choice is passed
    fn, plan, lut, what, _ = fb.decode_kernel()
    assert fn is mla.mla_decode_fp8 and plan is mla.get_mla_decode_metadata and "=triton" in what


# ---- Q as SGLang's (latent, rope) parts (SGLANG_H20_FP8_MLA_SPLIT_Q) -------------------------------------------------

def test_split_q_builds_versions_2_and_3_with_the_option(monkeypatch):
    cu = importlib.import_module("sgl_kernel_ext.mla_decode_cuda")
    asked = []
    monkeypatch.setattr(cu, "available", lambda version=1, defines=(): asked.append((version, defines)) or (True, ""))
    k = fb.decode_kernel("cuda-v2", split_q=True)
    assert k.fn.keywords == {"version": 2, "defines": ("MLA_SPLIT_Q",)} and k.takes_q_rope and "two parts" in k.what
    assert fb.decode_kernel("cuda", split_q=True).fn is cu.mla_decode_fp8_cuda  # v1 joins the parts itself
    assert fb.decode_kernel("cuda-v3", split_q=False).fn.keywords["defines"] == ()
    assert not fb.decode_kernel("triton", split_q=True).takes_q_rope  # the Triton kernel reads one tensor
    assert (2, ("MLA_SPLIT_Q",)) in asked and (3, ()) in asked
    monkeypatch.delenv("SGLANG_H20_FP8_MLA_SPLIT_Q", raising=False)  # on by default since measured (session 32)
    assert fb.decode_kernel("auto").takes_q_rope and (3, ("MLA_SPLIT_Q",)) in asked
    monkeypatch.setenv("SGLANG_H20_FP8_MLA_SPLIT_Q", "off")  # the switch, read when no choice is passed
    asked.clear()
    assert "two parts" not in fb.decode_kernel("auto").what and {(2, ()), (3, ())} <= set(asked)
    assert not any(d for _, d in asked)


def test_kernel_options_build_every_version_with_them(monkeypatch):
    """SGLANG_H20_FP8_MLA_KERNEL_OPTIONS (none by default): each CUDA version the backend may run, v1 included, is
    built with the listed design options (next to MLA_SPLIT_Q for v2/v3), and the log line names them."""
    cu = importlib.import_module("sgl_kernel_ext.mla_decode_cuda")
    asked = []
    monkeypatch.setattr(cu, "available", lambda version=1, defines=(): asked.append((version, defines)) or (True, ""))
    k = fb.decode_kernel("auto", split_q=True, options=("MLA_EAGER_RESCALE",))
    assert {(1, ("MLA_EAGER_RESCALE",)), (2, ("MLA_SPLIT_Q", "MLA_EAGER_RESCALE")),
            (3, ("MLA_SPLIT_Q", "MLA_EAGER_RESCALE"))} <= set(asked) and "MLA_EAGER_RESCALE" in k.what
    v1 = fb.decode_kernel("cuda", split_q=False, options=("MLA_VT_PRMT",)).fn
    assert v1.keywords == {"version": 1, "defines": ("MLA_VT_PRMT",)}
    monkeypatch.delenv("SGLANG_H20_FP8_MLA_KERNEL_OPTIONS", raising=False)
    asked.clear()
    assert "EAGER" not in fb.decode_kernel("auto").what
    assert not any("MLA_EAGER_RESCALE" in d for _, d in asked)  # none unless asked
    monkeypatch.setenv("SGLANG_H20_FP8_MLA_KERNEL_OPTIONS", "MLA_EAGER_RESCALE,MLA_VT_PRMT")
    what = fb.decode_kernel("auto").what
    assert "MLA_EAGER_RESCALE" in what and "MLA_VT_PRMT" in what
    from sglang_h20.settings import SettingError, _design_options
    assert _design_options("none") == () and _design_options("MLA_A, MLA_B MLA_A") == ("MLA_A", "MLA_B")
    with pytest.raises(SettingError):
        _design_options("-DMLA_A")


def test_decode_takes_q_and_k_as_parts():
    """What SGLang's absorbed attention passes a backend on its absorb-core list: q [B, H, 512] with q_rope, k [B,
    1, 512] with k_rope. The parts are stored and attended to exactly as the joined tensors (Triton kernel: joined
    by the backend; prefill: test_mla_prefill_reads_the_dequantized_prefix)."""
    b = Batch([40, 100], heads=16, seed=4)
    lyr = layer(0)
    for r, n in enumerate(b.lens):
        b.store(lyr, r, 0, n - 1)
    be = b.backend()
    assert not be.takes_q_rope  # CPU: the Triton kernel
    fbatch = decode_batch(b)
    be.init_forward_metadata(fbatch)
    q = torch.randn(2, 16, 576, generator=b.gen).bfloat16().to(DEVICE) * 0.5
    k = torch.cat([b.latent[r][n - 1:n] for r, n in enumerate(b.lens)])
    q_nope = q[..., :512].transpose(0, 1).contiguous().transpose(0, 1)  # strided like the absorbed bmm's output
    out = be.forward_decode(q_nope, k[..., :512], k[..., :512], lyr, fbatch, q_rope=q[..., 512:], k_rope=k[..., 512:])
    check_decode(b, out, q, lyr)
    joined = be.forward_decode(q, k, k[..., :512], lyr, fbatch)
    assert torch.equal(out, joined)


def test_decode_passes_the_parts_to_a_kernel_that_takes_them():
    b = Batch([70], heads=16, seed=5)
    be = b.backend()
    be.init_forward_metadata(decode_batch(b))
    seen = {}
    be._decode_fp8 = lambda q, *a, **kw: seen.update(q=q, **kw) or torch.zeros(1, 1, 16, 512)
    be.takes_q_rope = True
    q = torch.randn(1, 16, 512).to(DEVICE)
    be.forward_decode(q, None, None, layer(0), decode_batch(b), save_kv_cache=False, q_rope=torch.ones(1, 16, 64))
    assert seen["q"].shape == (1, 1, 16, 512) and seen["q_rope"].shape == (1, 1, 16, 64)


def test_take_q_in_parts_joins_sglangs_absorb_core_list(monkeypatch):
    """The list DeepSeek's absorbed attention checks exists in the installed sglang; joining it is idempotent and only
    happens when the switch is on (create_backend)."""
    utils = importlib.import_module("sglang.srt.models.deepseek_common.utils")
    names = utils.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS
    monkeypatch.setattr(utils, "FORWARD_ABSORB_CORE_ATTENTION_BACKENDS", list(names))
    assert "(latent, rope) parts" in fb.take_q_in_parts() and fb.take_q_in_parts()
    assert utils.FORWARD_ABSORB_CORE_ATTENTION_BACKENDS.count(fb.NAME) == 1 and fb.NAME not in names
    src = inspect.getsource(importlib.import_module("sglang.srt.models.deepseek_common.attention_forward_methods"
                                                    ".forward_mla"))
    assert "q_rope=q_pe" in src and "FORWARD_ABSORB_CORE_ATTENTION_BACKENDS" in src  # the contract relied on
    monkeypatch.setattr(fb, "ABSORB_CORE_LIST", "sglang.srt.no_such_module.LIST")
    assert fb.take_q_in_parts().startswith("Q stays joined")


def test_split_q_strides_only_where_the_kernel_can_read_the_parts():
    cu = importlib.import_module("sgl_kernel_ext.mla_decode_cuda")
    q = torch.randn(16, 3, 512, dtype=torch.bfloat16).transpose(0, 1).unsqueeze(1)  # [3, 1, 16, 512], head-major
    rope = torch.randn(3, 16, 192, dtype=torch.bfloat16)[..., 128:].unsqueeze(1)  # q_pe split off SGLang's q
    got = cu.split_q_strides(q, rope, 2, ("MLA_SPLIT_Q",))
    assert got is not None and got[0] is rope and got[1:] == (1024, 3 * 1024, 16 * 192 * 2, 192 * 2)
    assert cu.split_q_strides(q, rope, 1, ("MLA_SPLIT_Q",)) is None  # v1: its pre-pass reads one row
    assert cu.split_q_strides(q, rope, 3, ()) is None  # a build without the option
    assert cu.split_q_strides(q, rope, 2, ("MLA_SPLIT_Q", "MLA_PREPASS_Q")) is None
    assert cu.split_q_strides(q.float(), rope, 2, ("MLA_SPLIT_Q",)) is None
    odd = torch.randn(3, 1, 16, 200, dtype=torch.bfloat16)[..., 4:68]  # rows not 16-byte aligned
    assert cu.split_q_strides(q, odd, 2, ("MLA_SPLIT_Q",)) is None
