"""Megatron-LM's distributed-optimizer bucket layout: where each parameter's optimizer state sits in
its `dp_reshardable` checkpoint form (`optimizer.distributed.*`), as a pure function.

megatron-core 0.16.1 keeps a rank's parameters in one flat buffer per (param dtype, grad dtype)
and model chunk (`_ParamAndGradBuffer.__init__`, distributed/param_and_grad_buffer.py), with the
distributed optimizer on:
- parameters are placed in the *reverse* of the model chunk's `named_parameters()` order (roughly
  the order backprop produces their gradients);
- each parameter starts at a multiple of 64 elements (`_pad_start_of_param_if_needed`);
- a bucket closes after the parameter that makes it reach `bucket_size` elements (counted from the
  bucket's start), and before and after a parameter marked `shared_embedding` (the word embedding
  of the first stage and the output layer of the last when they are tied across pipeline stages);
  the last bucket closes after the last parameter. `bucket_size` is None (one bucket) without
  `--overlap-grad-reduce`, on pipeline stages other than the first, and for virtual model chunks
  after the first;
- a bucket's end is padded to a multiple of lcm(dp, 128) (lcm(dp, 128, 2**16) with
  `--ddp-pad-buckets-for-high-nccl-busbw`), where dp is the data-parallel (x context-parallel)
  size; the next bucket starts there.
The checkpoint (`DistributedOptimizer.sharded_param_state_dp_reshardable`, optimizer/
distrib_optimizer.py) stores, per model-parallel rank `dp_group_idx` (= pp rank x tp + tp rank),
buffer `gbuf_idx` and bucket `bucket_idx`, one 1-D tensor per state (`param`: fp32 main weights,
`exp_avg`, `exp_avg_sq`) of the bucket's unpadded length (`per_bucket_numel_unpadded`: from the
bucket's start to the end of its last parameter). A parameter's state is its tp-local shard,
flattened, at its offset from the bucket's start; the gaps of the 64-alignment hold no state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron.core.checkpointing.megatron_lm import EXPERT  # our routed experts' names, by global index

BUCKET_FORM = "dp_reshardable"  # common.pt['optimizer']['param_state_sharding_type'] of this form
PARAM_ALIGNMENT = 64  # elements: parameters start at 128-byte (16-bit) aligned addresses
BUCKET_ALIGNMENT = 128
HIGH_BUSBW_ALIGNMENT = 2**16
STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")  # fp32 main weights and Adam's moments


@dataclass(frozen=True)
class Bucket:
    """One bucket of a buffer: its padded length (`per_bucket_numel`), its unpadded length (the
    checkpoint tensor's), and each parameter's [start, stop) from the bucket's start."""

    numel: int
    numel_unpadded: int
    params: dict[str, tuple[int, int]]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def bucket_layout(
    params: list[tuple[str, int]],
    dp_size: int,
    bucket_size: int | None = None,
    shared_embedding: frozenset[str] = frozenset(),
    high_busbw_padding: bool = False,
) -> list[Bucket]:
    """The buckets of one buffer of megatron-core's distributed optimizer (see module doc).

    `params`: (name, number of elements of the tp-local shard) in the model chunk's
    `named_parameters()` order; `dp_size`: the data-parallel x context-parallel size; `bucket_size`:
    elements per bucket (None: one bucket); `shared_embedding`: names of parameters marked
    `shared_embedding`; `high_busbw_padding`: `--ddp-pad-buckets-for-high-nccl-busbw`.
    """
    divisor = math.lcm(dp_size, BUCKET_ALIGNMENT, *((HIGH_BUSBW_ALIGNMENT,) if high_busbw_padding else ()))
    buckets: list[Bucket] = []
    bucket_start, current = 0, {}

    def close(end: int) -> int:
        nonlocal bucket_start, current
        padded = _round_up(end, divisor)
        relative = {name: (a - bucket_start, b - bucket_start) for name, (a, b) in current.items()}
        buckets.append(Bucket(padded - bucket_start, end - bucket_start, relative))
        bucket_start, current = padded, {}
        return padded

    start = 0
    for name, numel in reversed(params):
        start = _round_up(start, PARAM_ALIGNMENT)
        shared = name in shared_embedding
        if shared and current:
            start = close(start)
        current[name] = (start, start + numel)
        end = start + numel
        start = close(end) if shared or (bucket_size is not None and end - bucket_start >= bucket_size) else end
    if current:
        close(end)
    return buckets


# megatron-core's local layer spec (get_gpt_layer_local_spec): a layer's parameters in registration
# order (TransformerLayer: input_layernorm, self_attention (its linear_proj is built before linear_qkv),
# pre_mlp_layernorm, mlp; weights before biases). An MoE layer's mlp (MoELayer with SequentialMLP
# experts, get_gpt_decoder_block_spec) registers its router, then its experts by index, then the shared
# experts; `mlp.experts` stands for all its experts (EXPERT_ORDER within one).
LOCAL_LAYER_ORDER = (
    "input_layernorm.weight",
    "input_layernorm.bias",
    "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.q_layernorm.weight",
    "self_attention.q_layernorm.bias",
    "self_attention.k_layernorm.weight",
    "self_attention.k_layernorm.bias",
    "pre_mlp_layernorm.weight",
    "pre_mlp_layernorm.bias",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias",
    "mlp.router.weight",
    "mlp.experts",
    "mlp.shared_experts.linear_fc1.weight",
    "mlp.shared_experts.linear_fc1.bias",
    "mlp.shared_experts.linear_fc2.weight",
    "mlp.shared_experts.linear_fc2.bias",
)
EXPERT_ORDER = ("linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias")
MODEL_ORDER = (
    "embedding.word_embeddings.weight",
    "embedding.position_embeddings.weight",
    "decoder.layers.",
    "decoder.final_layernorm.weight",
    "decoder.final_layernorm.bias",
    "output_layer.weight",
)


def _order_key(name: str) -> tuple:
    if name.startswith("decoder.layers."):
        layer, rest = name[len("decoder.layers.") :].split(".", 1)
        expert = EXPERT.fullmatch(rest)
        if expert:  # megatron-core names an expert by its local index: the same order as the global one
            inner = int(expert.group(1)), EXPERT_ORDER.index(expert.group(2))
            return MODEL_ORDER.index("decoder.layers."), int(layer), LOCAL_LAYER_ORDER.index("mlp.experts"), *inner
        return MODEL_ORDER.index("decoder.layers."), int(layer), LOCAL_LAYER_ORDER.index(rest)
    return (MODEL_ORDER.index(name),)


def megatron_parameter_order(names) -> list[str]:
    """`names` (ours: a GPTModel's parameters, global layer indices) in the `named_parameters()`
    order of megatron-core's GPTModel with the local layer spec (GPTModel: embedding, decoder,
    output_layer). Raises ValueError for a name that model does not have."""
    try:
        return sorted(names, key=_order_key)
    except ValueError:
        unknown = [n for n in names if not _known(n)]
        raise ValueError(f"not a parameter of megatron-core's local-spec GPTModel: {unknown[0]}") from None


def _known(name: str) -> bool:
    try:
        _order_key(name)
    except ValueError:
        return False
    return True


def _prefix(chained: int | None) -> str:
    """megatron-core's ChainedOptimizer prefixes each of its optimizers' names (`chained_<i>.`) when it holds
    several: with expert parallelism, 0 for the dense parameters and 1 for the expert-parallel ones."""
    return "" if chained is None else f"chained_{chained}."


def bucket_tensor_name(
    dp_group: int, gbuf: int, dtypes: tuple[torch.dtype, torch.dtype], bucket: int, key: str, chained: int | None = None
) -> str:
    """The checkpoint name of state `key` of a bucket (`dtypes`: the buffer's param and grad dtypes)."""
    return (
        f"{_prefix(chained)}optimizer.distributed.dp_group_idx_{dp_group}.gbuf_idx_{gbuf}.dtype_{dtypes}."
        f"bucket_idx_{bucket}.{key}"
    )


def dp_group_object_name(dp_group: int, key: str, chained: int | None = None) -> str:
    """The DCP name of one of the ShardedObjects a model-parallel rank's distributed optimizer writes
    (`optimizer`, `grad_scaler`, `per_bucket_numel`, `per_bucket_numel_unpadded`)."""
    return f"{_prefix(chained)}optimizer.distributed.dp_group_idx_{dp_group}.{key}/shard_0_1"
