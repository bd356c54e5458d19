"""Packaging for apt_model (Virtual Blackwell).

Runtime dependencies are deliberately few: torch (the framework we extend), psutil (host
memory figures on every OS), accelerate (its fork-safe CUDA/XPU/MPS availability checks and
output-dtype helpers), numpy (seeding and data), tqdm (progress bars in the main job and the CLI),
crc32c (hardware CRC-32C for swap-file checksums: ~11 GB/s vs zlib's ~2.2 GB/s, which would cap
the swap I/O threads below the disk's speed). matplotlib is optional (the ``plot`` extra): the run
report's PNG. Extras: ``test`` (pytest, transformers, matplotlib), ``interop`` (torchao, the FP4
interop tests' live reference), ``hf`` (transformers), ``plot`` (matplotlib).
"""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
version = {}
exec((HERE / "apt_model" / "base" / "version.py").read_text(), version)

setup(
    name="apt_model",
    version=version["__version__"],
    description="Virtual Blackwell: one switch that makes the accelerator you have behave like a bigger, newer one",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["apt_model", "apt_model.*"]),
    install_requires=[
        "torch>=2.6",
        "psutil>=5.9",
        "accelerate>=1.0",
        "numpy>=1.24",
        "tqdm>=4.60",
        "crc32c>=2.3",
    ],
    extras_require={
        # matplotlib: the run report's PNG is tested (the plot extra)
        "test": ["pytest>=8", "transformers>=4.45", "matplotlib>=3.7"],
        # torchao: the FP4 interop tests' live reference (it does not pull or replace torch). Its own
        # extra, so that an environment made for the tests does not hand it to transformers, which
        # imports it when present and prints torchao's load failures and torch deprecation warnings
        # (CI installs test + interop; without it the committed golden vectors still run)
        "interop": ["torchao==0.18.0"],
        "hf": ["transformers>=4.45"],
        "plot": ["matplotlib>=3.7"],
    },
    entry_points={"console_scripts": ["apt-vb=apt_model.cli.main:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
