"""The FP8 recipe: which format, which scaling, which GEMMs. A config object the linear layers receive.

Field names, choices and defaults follow megatron-core's TransformerConfig (`fp8`, `fp8_recipe`,
`fp8_margin`, `fp8_amax_history_len`, `fp8_amax_compute_algo`, `fp8_wgrad`, `tp_only_amax_red`,
`first_last_layers_bf16`, `num_layers_at_start_in_bf16`, `num_layers_at_end_in_bf16`) and its
refusals (first/last layers in BF16 with delayed scaling); the scaling itself follows Transformer
Engine's recipes (DelayedScaling, Float8CurrentScaling, Float8BlockScaling). docs/fp8.md says which.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = ("e4m3", "hybrid")
RECIPES = ("delayed", "tensorwise", "blockwise")
AMAX_ALGOS = ("max", "most_recent")
BLOCK = 128  # Float8BlockScaling's block edge: 1x128 activations and gradients, 128x128 weights
GEMM_MULTIPLE = 16  # torch._scaled_mm needs every GEMM dimension divisible by 16

# the three tensors of a linear layer an FP8 recipe quantises (TE's forward input, weight, output gradient)
INPUT, WEIGHT, GRAD = 0, 1, 2
TENSOR_NAMES = ("input", "weight", "grad")


@dataclass(frozen=True)
class Fp8Recipe:
    """megatron-core's defaults: delayed scaling, margin 0, a history of one amax, most recent."""

    format: str = "hybrid"  # e4m3: every tensor e4m3; hybrid: forward tensors e4m3, gradients e5m2
    recipe: str = "delayed"
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    wgrad: bool = True  # False (--no-fp8-wgrad): the weight-gradient GEMM in the model's precision
    tp_only_amax_red: bool = False  # delayed scaling: activation amax reduced over tp x cp only, not dp
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    param_gather: bool = False  # --fp8-param-gather (noted: weights are gathered in their own dtype here)

    def __post_init__(self):
        for name, value, valid in (
            ("--fp8-format", self.format, FORMATS),
            ("--fp8-recipe", self.recipe, RECIPES),
            ("--fp8-amax-compute-algo", self.amax_compute_algo, AMAX_ALGOS),
        ):
            if value not in valid:
                raise ValueError(f"{name} must be one of {', '.join(valid)}, got {value!r}")
        if self.margin < 0:
            raise ValueError(f"--fp8-margin must be >= 0, got {self.margin}")
        if self.amax_history_len < 1:
            raise ValueError(f"--fp8-amax-history-len must be >= 1, got {self.amax_history_len}")
        if self.first_last_layers_bf16 and self.recipe == "delayed":
            raise ValueError(
                "--first-last-layers-bf16 is not supported with --fp8-recipe delayed (as in Megatron-LM: "
                "delayed scaling's amax reduction spans every FP8 layer); use tensorwise or blockwise"
            )

    @property
    def delayed(self) -> bool:
        return self.recipe == "delayed"

    def dtype(self, tensor: int) -> torch.dtype:
        """The FP8 dtype of `tensor` (INPUT, WEIGHT or GRAD)."""
        return torch.float8_e5m2 if tensor == GRAD and self.format == "hybrid" else torch.float8_e4m3fn

    def layer_in_fp8(self, layer: int, num_layers: int) -> bool:
        """Whether global layer `layer` (0-based) runs its GEMMs in FP8 (megatron-core's first/last BF16 layers)."""
        if not self.first_last_layers_bf16:
            return True
        return self.num_layers_at_start_in_bf16 <= layer < num_layers - self.num_layers_at_end_in_bf16

    def validate_layers(self, num_layers: int, pipeline_stages: int) -> None:
        """megatron-core's bound: at most the layers of one pipeline stage at either end."""
        if not self.first_last_layers_bf16:
            return
        per_stage = num_layers // pipeline_stages
        for flag, value in (
            ("--num-layers-at-start-in-bf16", self.num_layers_at_start_in_bf16),
            ("--num-layers-at-end-in-bf16", self.num_layers_at_end_in_bf16),
        ):
            if not 0 <= value <= per_stage:
                raise ValueError(f"{flag} ({value}) must be between 0 and the layers per pipeline stage ({per_stage})")


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype (448 for e4m3fn, 57344 for e5m2)."""
    return torch.finfo(dtype).max
