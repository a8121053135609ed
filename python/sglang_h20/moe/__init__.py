"""MoE-side features: swapAB FP8 grouped GEMMs in SGLang's MoE paths (swapab.py)."""
