"""One way to get pyplot on a headless benchmark host.

Why: the GPU hosts have no display, and their Python carries an IPython stub without ``get_ipython``, which
pyplot probes when it installs its backend (seen on the H200 host: AttributeError from plt.subplots).
"""
from __future__ import annotations

import sys


def pyplot():
    """matplotlib.pyplot on the Agg backend; raises ImportError when matplotlib is missing."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    ipython = sys.modules.get("IPython")
    if ipython is not None and not hasattr(ipython, "get_ipython"):
        del sys.modules["IPython"]  # a stub: pyplot would call IPython.get_ipython() and fail
    import matplotlib.pyplot as plt

    return plt
