"""Weight-less DeepSeek-V3 model folders for `--load-format dummy` (CLI: scripts/make_model.py).

Two standard models carry every end-to-end claim of this project:
  dsv3-4l          4 layers of the real per-layer shape (1 dense + 3 MoE, 256 experts): ~36 GB
  dsv3-ep16-slice  all 61 layers, 16 routed experts (8 per token, one group): one GPU's share of a
                   16-GPU expert-parallel decode instance with DP attention, communication excluded: ~57 GB
The tokenizer is generated: a word-level vocabulary 'w<id>' filling all 129280 ids, so embedding and
lm_head have the real shapes and any 'w<id>' text is exactly one token.

usage: scripts/make_model.py OUT_ROOT [--models dsv3-4l dsv3-ep16-slice]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

VOCAB = 129280
BOS, EOS, PAD, UNK = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<unk>"

DEEPSEEK_V3 = {  # the published DeepSeek-V3 config; models below override a few keys
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": VOCAB,
}

MODELS = {
    "dsv3-4l": {"num_hidden_layers": 4, "first_k_dense_replace": 1},
    "dsv3-ep16-slice": {"n_routed_experts": 16, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1},
    # attention-heavy calibration model (python -m sglang_h20 calibrate mha-mla): 8 real MLA layers,
    # dense MLPs shrunk to 256 so that prefill time is attention plus a fixed per-request overhead
    "dsv3-attn8": {"num_hidden_layers": 8, "first_k_dense_replace": 8, "intermediate_size": 256},
    # one GPU's attention share under TP 8 (16 of the 128 heads), on dsv3-4l's layers: the h20_fp8_mla backend's
    # decode then runs the 16-head kernel (CUDA version 3), which the 128-head standard models never reach
    "dsv3-tp8-4l": {"num_hidden_layers": 4, "first_k_dense_replace": 1, "num_attention_heads": 16,
                    "num_key_value_heads": 16},
}
STANDARD = ("dsv3-4l", "dsv3-ep16-slice")


def random_words(rng, n: int) -> str:
    """n random words of the generated vocabulary: exactly n tokens (specials excluded)."""
    return " ".join(f"w{rng.randint(4, VOCAB - 1)}" for _ in range(n))


def config(name: str) -> dict:
    return {**DEEPSEEK_V3, **MODELS[name]}


def write_tokenizer(out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    specials = [BOS, EOS, PAD, UNK]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins the words with spaces again
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, vocab[BOS])])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(out / "tokenizer.json"))
    template = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    _dump(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "unk_token": UNK, "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": DEEPSEEK_V3["max_position_embeddings"], "chat_template": template})
    _dump(out / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK})


def _dump(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False))


def make(root: Path, name: str) -> Path:
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    _dump(out / "config.json", config(name))
    _dump(out / "generation_config.json", {"bos_token_id": DEEPSEEK_V3["bos_token_id"],
                                           "eos_token_id": DEEPSEEK_V3["eos_token_id"], "do_sample": False})
    write_tokenizer(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_root", type=Path, help="folder that receives one sub-folder per model")
    ap.add_argument("--models", nargs="+", default=list(STANDARD), choices=sorted(MODELS),
                    help="models to write (default: %(default)s; dsv3-attn8 is calibrate's attention-heavy model, "
                         "dsv3-tp8-4l is dsv3-4l with 16 heads)")
    a = ap.parse_args()
    if a.out_root.exists() and not a.out_root.is_dir():
        ap.error(f"out_root {a.out_root} is a file, not a folder")
    for name in a.models:
        print("wrote", make(a.out_root, name))


if __name__ == "__main__":
    main()
