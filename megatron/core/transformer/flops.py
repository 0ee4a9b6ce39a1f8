"""Model FLOPs of one training iteration (what the TFLOP/s in the log line counts).

Per token, the forward pass costs 2 FLOPs per multiply-accumulate of:
- per layer: QKV projection h x (a + 2 g) d, output projection a d x h,
  attention scores and context 2 x s x a d (full s x s, as Megatron counts it),
  MLP h x f x (3 for SwiGLU, 2 for GELU); on MoE layers instead the router h x E, the k experts a token
  is routed to (h x f_moe x 3 or 2 each) and the shared expert (Megatron counts the same experts);
- the output layer h x V (padded vocabulary).
Training = 3 x forward (backward costs twice the forward). Recomputation is not
counted: this is model FLOPs, so TFLOP/s / peak is the MFU.
"""

from __future__ import annotations


def flops_per_iteration(config, global_batch_size: int) -> float:
    h, s, d = config.hidden_size, config.seq_length, config.kv_channels
    a, g, f = config.num_attention_heads, config.num_query_groups, config.ffn_hidden_size
    mlp_mats = 3 if config.swiglu else 2
    attention = h * (a + 2 * g) * d + a * d * h + 2 * s * a * d
    dense = mlp_mats * h * f
    moe = 0
    if config.num_moe_experts is not None:
        shared = config.moe_shared_expert_intermediate_size or 0
        experts = config.moe_router_topk * config.moe_ffn_hidden_size + shared
        moe = h * config.num_moe_experts + mlp_mats * h * experts
    layers = sum(moe if config.is_moe_layer(i) else dense for i in range(config.num_layers))
    per_token = 2 * (config.num_layers * attention + layers + h * config.padded_vocab_size)
    return 3.0 * per_token * s * global_batch_size
