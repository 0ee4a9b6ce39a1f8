"""Per-rank memory estimator and layout planner (after Fujii et al., arXiv 2411.06465).

Parameter shapes and saved activations traced from our modules with fake tensors (trace.py),
the rest arithmetic on TransformerConfig + MemoryLayout; see docs/memory.md.
"""

from megatron.planning.estimator import DEFAULT_THRESHOLD, MemoryEstimate, RankEstimate, estimate_memory
from megatron.planning.layout import MemoryLayout

__all__ = ["DEFAULT_THRESHOLD", "MemoryEstimate", "MemoryLayout", "RankEstimate", "estimate_memory"]
