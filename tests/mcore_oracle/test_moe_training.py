"""Training an MoE GPT model: ours and megatron-core's, from the same weights, take the same 5 steps.

Our one-rank Llama-style model with MoE layers (Mixtral-like: softmax top-2, aux loss, z-loss; DeepSeek-like:
sigmoid, expert bias with its per-iteration update, group-limited top-4, per-sequence aux loss, shared expert,
a dense first layer) saves its initial state; megatron-core 0.16.1's GPTModel (local spec, SequentialMLP
experts; tests/mcore_oracle/driver.py, one gloo rank) loads it and trains 5 steps with its
optimizer (AdamW, warm-up + cosine, clipping) on one microbatch of the whole batch; ours trains the same way.
Losses and grad norms agree within 1e-5: the auxiliary losses' gradients enter both the same way.
"""

from __future__ import annotations

import json

import torch

from megatron.core.pipeline_parallel.microbatch import Microbatch
from megatron.core.transformer.model_fields import model_record
from megatron.training.trainer import Trainer
from tests.distributed import run_distributed
from tests.mcore_oracle.oracle import megatron_core_python, run_oracle
from tests.mcore_oracle.test_megatron_core import BATCH, OPTIMIZER, _close, _run, write_batch

MIXTRAL = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"]
MIXTRAL += ["--moe-aux-loss-coeff", "1e-1", "--moe-z-loss-coeff", "1e-2"]
DEEPSEEK = ["--num-experts", "8", "--moe-router-topk", "4", "--moe-ffn-hidden-size", "16"]
DEEPSEEK += ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]
DEEPSEEK += ["--moe-router-bias-update-rate", "1e-2", "--moe-router-num-groups", "4", "--moe-router-group-topk", "2"]
DEEPSEEK += ["--moe-router-topk-scaling-factor", "2.5", "--moe-router-load-balancing-type", "seq_aux_loss"]
DEEPSEEK += ["--moe-aux-loss-coeff", "1e-1", "--moe-shared-expert-intermediate-size", "32", "--moe-layer-freq", "[0,1]"]
CASES = {"mixtral": MIXTRAL, "deepseek": DEEPSEEK}
WHOLE_BATCH = ["--micro-batch-size", str(BATCH)]  # one microbatch, as the driver's one forward of the batch
# megatron-core TransformerConfig fields that our model record leaves out (training-only)
TRAINING_ONLY = (
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_router_bias_update_rate",
)
RECORDED = (
    "num_moe_experts",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_enable_expert_bias",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_topk_scaling_factor",
    "moe_shared_expert_intermediate_size",
    "moe_layer_freq",
)


def _ours(rank: int, directory: str, batch_file: str) -> dict:
    batch = torch.load(batch_file)
    out = {}
    for name, flags in CASES.items():
        trainer = Trainer(_run("llama", flags + WHOLE_BATCH, 1), torch.device("cpu"))
        module = trainer.chunks[0].module
        torch.save(dict(module.state_dict()), f"{directory}/{name}_state.pt")
        tokens, labels = batch["tokens"], batch["labels"]
        trainer.batch_fn = lambda iteration, t=tokens, lab=labels: (
            lambda m: Microbatch(t, lab, torch.ones_like(t, dtype=torch.float))
        )
        steps = [trainer.train_step(i) for i in range(1, 6)]
        c = trainer.run.model
        out[name] = {
            "loss": [s.loss for s in steps],
            "grad_norm": [s.grad_norm for s in steps],
            "moe": {k: getattr(c, k) for k in RECORDED + TRAINING_ONLY},
            "record": model_record(c),
        }
    return out


def test_moe_model_trains_as_megatron_core(tmp_path):
    megatron_core_python()
    batch = write_batch(tmp_path)
    ours = run_distributed(1, _ours, str(tmp_path), batch)[0]
    jobs = [
        {
            "tp": 1,
            "model": ours[name]["record"],
            "moe": ours[name]["moe"],
            "make_vocab_size_divisible_by": 64,
            "seed": 1234,
            "batch": batch,
            "global_batch_size": BATCH,
            "optimizer": OPTIMIZER,
            "ops": [
                {"op": "load_state", "file": str(tmp_path / f"{name}_state.pt")},
                {"op": "train", "iters": 5, "out": str(tmp_path / f"{name}_steps.json")},
            ],
        }
        for name in CASES
    ]
    run_oracle(jobs, tmp_path, world=1)
    for name in CASES:
        theirs = json.loads((tmp_path / f"{name}_steps.json").read_text())
        for key in ("loss", "grad_norm"):
            diff = max(abs(a - b) for a, b in zip(ours[name][key], theirs[key]))
            print(f"{name} {key}: max abs diff vs megatron-core {diff:.2e}")
            _close(ours[name][key], theirs[key], f"{name}: 5 steps' {key}")
