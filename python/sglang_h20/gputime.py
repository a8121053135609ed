"""Timing a GPU call the way the benchmarks report it: the median of triton's do_bench over a CUDA-graph
replay, so that launch overhead stays out (and the call is known to be capturable)."""
from __future__ import annotations


def graph_median_us(fn, rep_ms: int = 100, *, allow_eager: bool = True) -> tuple[float, str]:
    """(median µs, "graph" or "eager"). `fn` runs once outside the timed region (compile, JIT, autotune);
    a call that cannot be captured is timed eagerly when `allow_eager`, else the capture error propagates."""
    import torch
    import triton

    fn()
    torch.cuda.synchronize()
    run, how = fn, "eager"
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
            with torch.cuda.graph(graph, stream=stream):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        run, how = graph.replay, "graph"
    except Exception:
        torch.cuda.synchronize()
        if not allow_eager:
            raise
    return 1e3 * triton.testing.do_bench(run, warmup=10, rep=rep_ms, return_mode="median"), how
