"""megatron-core's MoELayer as an oracle, on one CPU rank (gloo), in the megatron-core environment:
    .venv-mcore/bin/python -I tests/mcore_oracle/moe_driver.py SPEC.json
SPEC (JSON): {"port": p, "cases": [case, ...]}. A case: {"config": TransformerConfig keyword arguments of
megatron-core (MoE fields by its names), "state": a torch.save file of the layer's weights and expert bias under
megatron-core's names, "inputs": a torch.save file of {"x": [s, b, h], "grad": [s, b, h], "scale": aux-loss
backward scale}, "out": file}. Each case builds MoELayer (local spec, SequentialMLP experts), loads the state,
runs forward and backward in training mode and writes {"y", "x_grad", "grads" by name, "logged" (the aux-loss
tracker's values), "expert_bias" (after megatron-core's once-per-iteration update, when enabled)} to "out".
"""

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_patches  # noqa: E402,F401  (before any other megatron.core import)

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias  # noqa: E402
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.core.transformer.moe.moe_utils import (  # noqa: E402
    MoEAuxLossAutoScaler,
    get_moe_layer_wise_logging_tracker,
)
from megatron.core.transformer.spec_utils import build_module  # noqa: E402


def run_case(case: dict) -> None:
    kwargs = dict(case["config"])
    swiglu = kwargs.pop("swiglu")
    config = TransformerConfig(
        **kwargs,
        gated_linear_unit=swiglu,
        activation_func=torch.nn.functional.silu if swiglu else torch.nn.functional.gelu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
        moe_router_fusion=False,
        moe_permute_fusion=False,
    )
    spec = get_moe_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
    layer = build_module(spec, config=config, layer_number=1)
    layer.set_layer_number(1)
    missing, unexpected = layer.load_state_dict(torch.load(case["state"]), strict=False)
    assert not unexpected and all("_extra_state" in k for k in missing), (missing, unexpected)
    layer.train()
    inputs = torch.load(case["inputs"])
    x = inputs["x"].clone().requires_grad_(True)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(inputs["scale"]))
    get_moe_layer_wise_logging_tracker().clear()  # the names of earlier cases too
    y, _ = layer(x)
    y.backward(inputs["grad"])
    logged = {name: float(v["values"][0]) for name, v in get_moe_layer_wise_logging_tracker().items()}
    out = {
        "y": y.detach(),
        "x_grad": x.grad,
        "grads": {name: p.grad for name, p in layer.named_parameters()},
        "logged": logged,
    }
    if config.moe_router_enable_expert_bias:
        _update_router_expert_bias([layer], config)
        out["expert_bias"] = layer.router.expert_bias.clone()
    torch.save(out, case["out"])


if __name__ == "__main__":
    spec = json.load(open(sys.argv[1]))
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    for case in spec["cases"]:
        run_case(case)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
