"""sgl_kernel_ext: our Hopper kernels behind a small, flat API (in DeepGEMM's manner).

Each kernel module ships its launcher and a plain-torch reference of the same math.
"""

__version__ = "0.1.0"

from sgl_kernel_ext.mla_decode import (  # FP8 MLA decode (FlashMLA-style interface)
    KV_BYTES_PER_TOKEN,
    MLADecodeMetadata,
    dequantize_kv_fp8,
    get_mla_decode_metadata,
    make_mla_inputs,
    mla_decode_exact,
    mla_decode_fp8,
    mla_decode_reference,
    quantize_kv_fp8,
    quantize_q_fp8,
    set_splits,
    splits_lut,
    store_kv_fp8,
    store_kv_fp8_torch,
)

from sgl_kernel_ext.grouped_gemm_fp8 import (  # noqa: F401  swapAB FP8 grouped GEMMs (MoE)
    choose_variant, fp8_gemm_nt, grouped_gemm_reference, m_grouped_fp8_gemm_nt_contiguous,
    m_grouped_fp8_gemm_nt_masked,
)
from sgl_kernel_ext.quant import (  # noqa: F401  DeepSeek block-FP8 quantization
    per_block_quant_fp8, per_token_group_quant_fp8, silu_mul_quant_fp8,
)
