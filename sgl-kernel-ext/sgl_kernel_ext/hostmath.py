"""Host-side integer helpers for the launchers (grid sizes, tile counts)."""


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative a and positive b. The launchers' own: `triton.cdiv` is a ConstexprFunction,
    about 3 us per call from Python, and a dense GEMM call made six of them (host time per launch, eager steps)."""
    return -(-a // b)
