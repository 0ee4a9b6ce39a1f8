"""A stack of transformer layers with Megatron's full-layer recomputation options."""

from __future__ import annotations

import torch

from megatron.core.tensor_parallel.random import recompute
from megatron.core.transformer.layer import TransformerLayer
from megatron.core.transformer.norm import Norm


def layer_groups(config, n_layers: int, training: bool = True) -> list[tuple[int, int, bool]]:
    """(start, end, recomputed?) of the groups a block of `n_layers` layers runs, following
    --recompute-granularity full and --recompute-method (the memory estimator traces one group of each kind)."""
    if config.recompute_granularity != "full" or not training:
        return [(0, n_layers, False)]
    n = config.recompute_num_layers
    if config.recompute_method == "uniform":
        return [(start, min(start + n, n_layers), True) for start in range(0, n_layers, n)]
    # block: the first n layers of this chunk are recomputed, the rest keep activations
    return [(i, i + 1, i < n) for i in range(n_layers)]


class TransformerBlock(torch.nn.Module):
    """Layers `layer_ids` (global indices, which name the modules: `layers.<global index>`,
    so names agree in every pipeline layout) and, on the last stage, the final norm."""

    def __init__(
        self,
        config,
        layer_ids,
        *,
        tp_group,
        rng_tracker,
        post_process: bool,
        cp_group=None,
        expert_groups=None,
        device=None,
    ):
        super().__init__()
        self.config = config
        self.rng_tracker = rng_tracker
        self.layers = torch.nn.ModuleDict(
            {
                str(i): TransformerLayer(
                    config,
                    tp_group=tp_group,
                    rng_tracker=rng_tracker,
                    cp_group=cp_group,
                    layer_index=i,
                    expert_groups=expert_groups,
                    device=device,
                )
                for i in layer_ids
            }
        )
        self.final_layernorm = Norm(config, config.hidden_size, device) if post_process else None

    def _recomputed_groups(self):
        """Yield (layers, recompute?) in order, following --recompute-method."""
        layers = list(self.layers.values())
        for start, end, recomputed in layer_groups(self.config, len(layers), self.training):
            yield layers[start:end], recomputed

    def forward(self, x, rotary_angles=None, attention_mask=None):
        for group, recomputed in self._recomputed_groups():

            def run(h, group=group):
                for layer in group:
                    h = layer(h, rotary_angles, attention_mask)
                return h

            x = recompute(run, self.rng_tracker, x) if recomputed else run(x)
        return self.final_layernorm(x) if self.final_layernorm is not None else x
