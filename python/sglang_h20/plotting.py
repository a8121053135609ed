"""One way to get pyplot on a headless benchmark host, and one way to write its figures.

Why: the GPU hosts have no display, and their Python carries an IPython stub without ``get_ipython``, which
pyplot probes when it installs its backend (seen on the H200 host: AttributeError from plt.subplots). And every
plot lands in benchmark/results, which travels to the GPU host with each device call under a size cap: a line plot
needs no more than 256 colours, and a palette PNG is about a third of matplotlib's RGBA one (session 36: 89 plots,
7.2 -> 2.6 MB, by eye the same).

    python -m sglang_h20.plotting benchmark/results/*/*.png    # re-encode existing plots in place
"""
from __future__ import annotations

import io
import sys
from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend; raises ImportError when matplotlib is missing."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    ipython = sys.modules.get("IPython")
    if ipython is not None and not hasattr(ipython, "get_ipython"):
        del sys.modules["IPython"]  # a stub: pyplot would call IPython.get_ipython() and fail
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig, dpi: int = 120, **savefig_kw) -> bytes:
    """The figure as a 256-colour palette PNG (matplotlib's own RGBA PNG where Pillow is missing); closes it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, **savefig_kw)
    pyplot().close(fig)
    return compact_png(buf.getvalue())


def save_png(fig, path, dpi: int = 120, **savefig_kw) -> Path:
    """Write the figure to path as a palette PNG (png_bytes), creating its folder; closes the figure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png_bytes(fig, dpi, **savefig_kw))
    return path


def compact_png(data: bytes) -> bytes:
    """PNG bytes re-encoded with an adaptive 256-colour palette, no dithering; the input when that is not smaller."""
    try:
        from PIL import Image
    except ImportError:
        return data
    image = Image.open(io.BytesIO(data)).convert("RGB")
    out = io.BytesIO()
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
        out, format="PNG", optimize=True)
    return out.getvalue() if out.tell() < len(data) else data


def main(argv=None) -> int:
    paths = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print("usage: python -m sglang_h20.plotting PNG...  (re-encodes each in place as a palette PNG)",
              file=sys.stderr)
        return 2
    before = after = 0
    for path in paths:
        data = path.read_bytes()
        small = compact_png(data)
        if len(small) < len(data):
            path.write_bytes(small)
        before, after = before + len(data), after + len(small)
    print(f"{len(paths)} PNGs: {before} -> {after} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
