"""Give a transformer layer's linear layers their FP8 GEMMs: QKV, projection, fc1, fc2 and the experts'.

The LM head, embeddings and the router stay in the model's precision (as in Megatron-LM, whose FP8
context wraps the transformer layers only); so do the layers --first-last-layers-bf16 keeps in BF16.
"""

from __future__ import annotations

from megatron.core.fp8.linear import Fp8Gemms
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.moe.experts import ExpertLinear


def attach_fp8(layer, config, layer_index: int, *, tp_group, cp_group, expert_groups) -> None:
    """Set `fp8` on every linear layer of transformer layer `layer_index` that runs in FP8 under `config.fp8`."""
    recipe = config.fp8
    if recipe is None or not recipe.layer_in_fp8(layer_index, config.num_layers):
        return

    def cast_impl(device_type: str) -> str:
        return config.kernel_paths(device_type).fp8_cast.impl

    for module in layer.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.fp8 = Fp8Gemms(
                recipe,
                module,
                weight_group=tp_group,
                activation_groups=(tp_group, cp_group),
                expert=False,
                cast_impl=cast_impl,
            )
        elif isinstance(module, ExpertLinear):
            etp = expert_groups.etp if expert_groups is not None else None
            module.fp8 = Fp8Gemms(
                recipe, module, weight_group=etp, activation_groups=(etp,), expert=True, cast_impl=cast_impl
            )
