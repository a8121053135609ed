"""The KV pool of the h20_fp8_mla backend: SGLang's MLA pool with the latent stored in our FP8 format.

Layout per layer (both indexed by SGLang's flat token slot, slot = page * page_size + offset):

    kv_buffer[layer]        [size + page_size, 1, 576]             uint8 (float8_e4m3fn bits), as upstream
    kv_scale_buffer[layer]  [size + page_size, NUM_KV_SCALES]      float32, one scale per channel group

= KV_BYTES_PER_TOKEN = 576 + 4 * NUM_KV_SCALES bytes per token per layer (584 with the kernel's current two
scales, latent and rope), against 1152 for the BF16 pool. The format is sgl_kernel_ext.mla_decode's (see its
module docstring); only its constants and public functions are used here, so a change of NUM_KV_SCALES
carries through.

Why a subclass and not a side table: every upstream writer (decode's set_kv_buffer, the MHA prefill's
set_mla_kv_buffer) and the one upstream reader of cached tokens that we keep (the chunked-prefix MHA path's
get_mla_kv_buffer) already go through the pool's methods, so overriding them is the whole integration:
writes quantize the new tokens on the fly (store_kv_fp8, one launch), reads dequantize only the gathered
tokens. Nothing ever passes over the whole pool.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from sglang.srt.constants import GPU_MEMORY_TYPE_KV_CACHE
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, unwrap_write_loc

from sgl_kernel_ext.mla_decode import (
    HEAD_DIM_QK, KV_BYTES_PER_TOKEN, KV_LORA_RANK, NUM_KV_SCALES, dequantize_kv_fp8, store_kv_fp8,
)

FP8 = torch.float8_e4m3fn
GATHER_CHUNK = 16384  # tokens per dequantize step: bounds the fp32 temporary (16384 x 576 x 4 B = 38 MB)


class FP8MLATokenToKVPool(MLATokenToKVPool):
    """MLATokenToKVPool whose latent is FP8 with per-(token, channel group) float32 scales."""

    bytes_per_token_per_layer = KV_BYTES_PER_TOKEN

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.dtype != FP8 or self.kv_cache_dim != HEAD_DIM_QK or self.kv_lora_rank != KV_LORA_RANK:
            raise ValueError(f"FP8MLATokenToKVPool needs dtype {FP8} and a {KV_LORA_RANK}+64 latent, got "
                             f"{self.dtype}, kv_lora_rank={self.kv_lora_rank}, dim={self.kv_cache_dim}")
        if (self.size + self.page_size) % self.page_size:
            raise ValueError(f"pool size {self.size} is not a whole number of {self.page_size}-token pages")

    def _create_buffers(self):
        super()._create_buffers()
        with self.memory_saver_adapter.region(GPU_MEMORY_TYPE_KV_CACHE):
            with torch.cuda.use_mem_pool(self.custom_mem_pool) if self.custom_mem_pool else nullcontext():
                self.kv_scale_buffer = [
                    torch.zeros((self.size + self.page_size, NUM_KV_SCALES), dtype=torch.float32, device=self.device)
                    for _ in range(self.layer_num)
                ]

    def _clear_buffers(self):
        super()._clear_buffers()
        del self.kv_scale_buffer

    def get_kv_size_bytes(self):
        return sum(t.nbytes for t in self.kv_buffer) + sum(t.nbytes for t in self.kv_scale_buffer)

    # ---- what the decode kernel reads ----------------------------------------------------------------------

    def kv_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(kv_fp8 [pages, page_size, 576] float8_e4m3fn, scales [pages, page_size, NUM_KV_SCALES]) views."""
        data = self.get_key_buffer(layer_id)  # waits for layer-wise loading like upstream readers do
        scales = self.kv_scale_buffer[layer_id - self.start_layer]
        return (data.view(-1, self.page_size, HEAD_DIM_QK),
                scales.view(-1, self.page_size, NUM_KV_SCALES))

    # ---- writes: quantize the new tokens only ----------------------------------------------------------------

    def _store(self, layer_id: int, loc: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor | None = None) -> None:
        kv, scales = self.kv_cache(layer_id)
        if rope is None:
            store_kv_fp8(kv, scales, loc, latent.reshape(-1, HEAD_DIM_QK))
        else:
            store_kv_fp8(kv, scales, loc, latent.reshape(-1, KV_LORA_RANK), rope.reshape(-1, rope.shape[-1]))

    def set_kv_buffer(self, layer, loc_info, cache_k: torch.Tensor, cache_v: torch.Tensor, *args, **kwargs):
        """Decode and absorbed-MLA writes: cache_k is the whole latent [n, 1, 576]; cache_v (its first 512
        channels) is not stored twice."""
        loc, _, _ = unwrap_write_loc(loc_info)
        self._store(layer.layer_id, loc, cache_k)

    def set_mla_kv_buffer(self, layer, loc: torch.Tensor, cache_k_nope: torch.Tensor, cache_k_rope: torch.Tensor):
        """MHA prefill and the absorbed decode with Q/K in parts write the latent as two parts; the store kernel
        reads both where they are (a join cost 2 us per layer at batch 48 in the decode profile)."""
        self._store(layer.layer_id, loc, cache_k_nope, cache_k_rope.to(cache_k_nope.dtype))

    # ---- reads of cached tokens by index (prefill) -----------------------------------------------------------

    def _dequantize_into(self, layer_id: int, loc: torch.Tensor, *outs: torch.Tensor) -> None:
        """Gather the tokens at slots loc, dequantize, and write their channels in order across outs [n, 1, c]."""
        data = self.get_key_buffer(layer_id).view(-1, HEAD_DIM_QK)
        scales = self.kv_scale_buffer[layer_id - self.start_layer]
        loc = loc.reshape(-1).long()
        for s in range(0, loc.shape[0], GATHER_CHUNK):
            idx = loc[s:s + GATHER_CHUNK]
            latent = dequantize_kv_fp8(data[idx], scales[idx])
            c0 = 0
            for out in outs:
                out[s:s + GATHER_CHUNK, 0] = latent[:, c0:c0 + out.shape[-1]]
                c0 += out.shape[-1]

    def dequantize_tokens(self, layer_id: int, loc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The latent of the tokens at slots loc, [n, 1, 576] in dtype: a gather, never the whole pool."""
        out = torch.empty((loc.numel(), 1, HEAD_DIM_QK), dtype=dtype, device=self.kv_buffer[0].device)
        self._dequantize_into(layer_id, loc, out)
        return out

    def get_mla_kv_buffer(self, layer, loc: torch.Tensor, dst_dtype: torch.dtype | None = None):
        """(k_nope [n, 1, 512], k_rope [n, 1, 64]), contiguous as upstream returns them, dequantized (default
        bf16): the chunked-prefix MHA prefill feeds k_nope to kv_b_proj."""
        n, dtype, dev = loc.numel(), dst_dtype or torch.bfloat16, self.kv_buffer[0].device
        nope = torch.empty((n, 1, KV_LORA_RANK), dtype=dtype, device=dev)
        rope = torch.empty((n, 1, HEAD_DIM_QK - KV_LORA_RANK), dtype=dtype, device=dev)
        self._dequantize_into(layer.layer_id, loc, nope, rope)
        return nope, rope

    # ---- bookkeeping that must carry the scales along --------------------------------------------------------

    def move_kv_cache(self, tgt_loc: torch.Tensor, src_loc: torch.Tensor):
        if tgt_loc.numel() == 0:
            return
        tgt, src = tgt_loc.reshape(-1).long(), src_loc.reshape(-1).long()
        for buf in (*self.kv_buffer, *self.kv_scale_buffer):
            buf[tgt] = buf[src]

    def get_cpu_copy(self, indices, mamba_indices=None):
        return [(kv[indices].cpu(), sc[indices].cpu()) for kv, sc in zip(self.kv_buffer, self.kv_scale_buffer)]

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None):
        for (kv_cpu, sc_cpu), kv, sc in zip(kv_cache_cpu, self.kv_buffer, self.kv_scale_buffer):
            kv[indices] = kv_cpu.to(kv.device)
            sc[indices] = sc_cpu.to(sc.device)

    def get_contiguous_buf_infos(self):
        raise NotImplementedError("h20_fp8_mla: PD-disaggregation KV transfer of the FP8 pool (data + scales) "
                                  "is not implemented; the plugin refuses --disaggregation-mode at startup")
