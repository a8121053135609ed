"""sglang-h20: an SGLang 0.5.17 extension for DeepSeek-V3/R1 serving on Hopper (H20 first).

Two import packages ship in one distribution:
  sglang_h20      (python/)          the plugin: settings, guards, feature hooks, tools
  sgl_kernel_ext  (sgl-kernel-ext/)  our kernels, importable on their own
SGLang discovers the plugin through the `sglang.srt.plugins` entry point.
"""
from setuptools import find_packages, setup

ROOTS = {"sglang_h20": "python", "sgl_kernel_ext": "sgl-kernel-ext"}


def packages():
    found = {}
    for top, root in ROOTS.items():
        for pkg in find_packages(root, include=[top, top + ".*"]):
            found[pkg] = f"{root}/{pkg.replace('.', '/')}"
    return found


PACKAGES = packages()

setup(
    name="sglang-h20",
    version="0.1.0",
    description="Faster DeepSeek-V3/R1 serving with SGLang on NVIDIA Hopper (H20 first), as an SGLang plugin",
    python_requires=">=3.11",
    packages=sorted(PACKAGES),
    package_dir=PACKAGES,
    package_data={"sglang_h20": ["tables/*.json", "nightly/configs/*.toml"],
                  "sgl_kernel_ext": ["csrc/*.cu", "csrc/*.cuh"]},  # compiled at first use (mla_decode_cuda.py)
    install_requires=["sglang==0.5.17"],
    entry_points={
        "sglang.srt.plugins": ["sglang_h20 = sglang_h20.plugin:load"],
        "console_scripts": ["sglang-h20 = sglang_h20.__main__:main"],
    },
)
