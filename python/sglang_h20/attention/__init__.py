"""Attention-side features: the prefill MHA/MLA policy and (later) the FP8 MLA decode backend."""
