"""Lightweight observability for MoE serving (switch SGLANG_H20_OBSERVE = fraction of decode steps).

stages   sampled per-layer, per-stage timing of the DeepSeek decode step (CUDA events, CPU fallback)
         and per-rank expert load, through SGLang hooks (`hooks(settings)`)
export   rolling JSON-lines dumps and Prometheus series on SGLang's /metrics
analyze  robust (median/MAD) anomaly detection across ranks and over time, classified as
         compute / imbalance / communication
report   self-contained HTML report with matplotlib heatmaps and plots
synth    recorded-like synthetic dumps with injected faults (demos, tests)

CLI: python -m sglang_h20.observe {report,synth,analyze}
"""
