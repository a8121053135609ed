"""Plots are written as palette PNGs: a third of the bytes, the same picture (benchmark/results travels to the GPU
host with every device call, under a size cap)."""
import io
import sys
import types

import numpy as np
import pytest

from sglang_h20 import plotting

Image = pytest.importorskip("PIL.Image")


def figure():
    plt = plotting.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    x = np.linspace(1, 100, 200)
    for i, style in enumerate(("-", "--", ":")):
        ax.loglog(x, x ** (1 + 0.2 * i), style, label=f"line {i}")
    ax.scatter(x[::10], x[::10] ** 1.1, marker="^", alpha=0.7)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return fig


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.int16)


def test_save_png_writes_a_smaller_png_of_the_same_picture(tmp_path):
    fig = figure()
    raw = io.BytesIO()
    fig.savefig(raw, format="png", dpi=100)
    path = plotting.save_png(fig, tmp_path / "sub" / "plot.png", dpi=100)
    small = path.read_bytes()
    assert Image.open(path).mode == "P" and len(small) < 0.7 * len(raw.getvalue())
    before, after = pixels(raw.getvalue()), pixels(small)
    assert before.shape == after.shape
    diff = np.abs(before - after)
    assert diff.mean() < 1.0 and np.percentile(diff, 99.9) <= 24  # antialiased edges move a little, nothing else


def test_the_command_re_encodes_plots_in_place_and_keeps_what_would_grow(tmp_path, capsys, monkeypatch):
    fig = figure()
    raw = io.BytesIO()
    fig.savefig(raw, format="png", dpi=80)
    big = tmp_path / "a.png"
    big.write_bytes(raw.getvalue())
    tiny = tmp_path / "b.png"
    Image.new("P", (4, 4)).save(tiny)  # already a palette image: re-encoding cannot shrink it
    tiny_bytes = tiny.read_bytes()
    assert plotting.main([str(big), str(tiny)]) == 0
    assert len(big.read_bytes()) < len(raw.getvalue()) and Image.open(big).mode == "P"
    assert tiny.read_bytes() == tiny_bytes
    total_after = len(big.read_bytes()) + len(tiny_bytes)
    assert capsys.readouterr().out == f"2 PNGs: {len(raw.getvalue()) + len(tiny_bytes)} -> {total_after} bytes\n"
    assert plotting.main([]) == 2
    monkeypatch.setattr(sys, "argv", ["plotting", str(tiny)])  # the command line's paths, the program name not one
    assert plotting.main() == 0 and capsys.readouterr().out == f"1 PNGs: {len(tiny_bytes)} -> {len(tiny_bytes)} bytes\n"


def test_pyplot_drops_an_ipython_stub_and_keeps_a_real_one(monkeypatch):
    """A stub IPython module (no get_ipython) would make pyplot's import fail; a real one stays loaded."""
    stub = types.ModuleType("IPython")
    monkeypatch.setitem(sys.modules, "IPython", stub)
    plotting.pyplot()
    assert "IPython" not in sys.modules
    real = types.ModuleType("IPython")
    real.get_ipython = lambda: None
    monkeypatch.setitem(sys.modules, "IPython", real)
    plotting.pyplot()
    assert sys.modules["IPython"] is real
