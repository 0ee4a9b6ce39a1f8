"""Install the `megatron` and `kernels` packages.

torch is required but never upgraded here: GPU users bring their own build, and a
CPU-only machine should run `pip install torch==2.13.0` first (see README.md).
"""

from setuptools import find_packages, setup

setup(
    name="megatron-4d",
    version="0.1.0",
    description="Megatron-style 4D-parallel (TP/SP, CP, DP, interleaved PP) training for GPT and Llama models",
    packages=find_packages(include=["megatron", "megatron.*", "kernels", "kernels.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.5",  # SDPA enable_gqa; checked again at start-up
        "numpy",
        "regex",
        "sentencepiece",
        "triton>=3.2; sys_platform == 'linux'",
        "tqdm",
        "isal",  # checkpoint CRC-32s at 3x zlib's speed (megatron/core/checkpointing/integrity.py)
    ],
    extras_require={"test": ["pytest"], "plot": ["matplotlib"], "tensorboard": ["tensorboard"]},
)
