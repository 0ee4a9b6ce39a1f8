"""Context parallelism: causal attention over a sequence split across cp ranks in Megatron's
load-balanced chunks (see `sharding` for the split, `ring_attention` for the attention)."""

from megatron.core.context_parallel.comm import COMM_STATS
from megatron.core.context_parallel.ring_attention import COMM_TYPES, context_parallel_attention
from megatron.core.context_parallel.sharding import positions, shard, unshard

__all__ = ["COMM_STATS", "COMM_TYPES", "context_parallel_attention", "positions", "shard", "unshard"]
