"""Planning a run before it starts: the per-rank memory estimate (after Fujii et al., arXiv
2411.06465), the fit rule (one verdict for the planner, the start-up check and the tools), the
layout planner, the step-time model and the pipeline simulator. Above megatron/core and
megatron/data, below megatron/training: it reads the run's own config objects (TransformerConfig,
ParallelConfig with its DDPConfig, OffloadConfig; layout.py) and imports nothing from training.

Parameter shapes and saved activations traced from our modules with fake tensors (trace.py),
the rest arithmetic on TransformerConfig + MemoryLayout; see docs/memory.md and docs/planner.md.
"""

from megatron.planning.estimator import MemoryEstimate, RankEstimate, estimate_memory
from megatron.planning.fit_rule import FitVerdict, fit_verdict
from megatron.planning.layout import MemoryLayout

__all__ = ["FitVerdict", "MemoryEstimate", "MemoryLayout", "RankEstimate", "estimate_memory", "fit_verdict"]
