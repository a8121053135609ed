"""sglang-h20: DeepSeek-V3/R1 serving on Hopper (H20 first), as an SGLang 0.5.17 plugin."""

__version__ = "0.1.0"
