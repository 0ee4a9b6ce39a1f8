"""The tests' multi-process launcher (shared with the CPU benchmarks)."""

from megatron.testing.forked_ranks import run_distributed

__all__ = ["run_distributed"]
