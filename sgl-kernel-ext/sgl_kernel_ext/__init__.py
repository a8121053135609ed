"""sgl_kernel_ext: our Hopper kernels behind a small, flat API (in DeepGEMM's manner).

Each kernel module ships its launcher and a plain-torch reference of the same math.
"""

__version__ = "0.1.0"
