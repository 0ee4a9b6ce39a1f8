"""Self-attention with tensor-parallel heads and grouped-query attention.

The fused QKV projection's output rows are laid out per query group:
[q heads of group 0, k of group 0, v of group 0, q heads of group 1, ...], so
splitting the rows contiguously across tp ranks hands each rank whole groups.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kernels.attention_rule import pinned_backend
from kernels.dispatch import UNFUSED
from kernels.flash_attention import flash_attention
from kernels.rope import rope
from megatron.core.context_parallel.ring_attention import context_parallel_attention
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.random import recompute
from megatron.core.transformer.norm import Norm


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Megatron's --reset-attention-mask as SDPA's boolean mask [b, 1, s, s]: query i sees key j
    when j <= i and both are in the same document. `document_ids` [b, s] must cover whole
    sequences (not a cp rank's two chunks: refused at start-up)."""
    s = document_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=document_ids.device).tril()
    return (causal & (document_ids[:, :, None] == document_ids[:, None, :])).unsqueeze(1)


def unfused_attention(q, k, v, dropout_p: float, attention_mask=None):
    """megatron-core's DotProductAttention (its local layer spec) step by step, each step rounded to
    q's dtype as there: scores q k^T / sqrt(d) (one baddbmm), hidden keys set to -10000, softmax
    (computed in fp32 by torch either way: --attention-softmax-in-fp32 changes nothing), dropout,
    probabilities @ v. q [s, b, h, d], k/v [s, b, h_kv, d] -> [s, b, h, d]; `attention_mask`:
    `document_mask` (True: visible) or None (causal)."""
    s, b, h, d = q.shape
    k, v = (t.repeat_interleave(h // k.shape[2], dim=2) for t in (k, v))
    q, k, v = (t.reshape(s, b * h, d).transpose(0, 1) for t in (q, k, v))  # [b * h, s, d]
    scores = torch.baddbmm(q.new_empty(b * h, s, s), q, k.transpose(1, 2), beta=0.0, alpha=1.0 / math.sqrt(d))
    hidden = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1) if attention_mask is None else ~attention_mask
    probs = torch.softmax(scores.view(b, h, s, s).masked_fill(hidden, -10000.0), dim=-1)
    probs = F.dropout(probs, dropout_p) if dropout_p > 0.0 else probs
    return torch.bmm(probs.view(b * h, s, s), v).view(b, h, s, d).permute(2, 0, 1, 3)


def core_attention(q, k, v, dropout_p: float, paths, cp_group=None, cp_comm_type: str = "p2p", attention_mask=None):
    """Causal softmax(q k^T / sqrt(d)) v. q [s, b, h, d], k/v [s, b, h_kv, d] -> [s, b, h, d].

    `paths` (kernels/dispatch.py `KernelPaths`, for this call's dropout, mask and cp group) says
    which runs: megatron-core's unfused attention ("unfused", `unfused_attention`); across the cp
    ranks on this rank's load-balanced share of the sequence ("ring", no dropout there: refused at
    start-up); the flash-attention kernel or its torch reference ("flash_attention"); or torch's
    SDPA ("sdpa"): the kernel has no dropout and no document boundaries (`attention_mask`,
    `document_mask`; --attention-backend triton and cp with it are refused at start-up).
    """
    impl = paths.attention_kernel.impl
    if paths.attention == UNFUSED:
        return unfused_attention(q, k, v, dropout_p, attention_mask)
    if paths.attention == "ring":
        out = context_parallel_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), cp_group, comm_type=cp_comm_type, impl=impl
        )
        return out.transpose(0, 1)
    if paths.attention == "flash_attention":
        out = flash_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), causal=True, impl=impl)
        return out.transpose(0, 1)
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    with pinned_backend(paths.sdpa_backend):
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attention_mask,
            dropout_p=dropout_p,
            is_causal=attention_mask is None,
            enable_gqa=k.shape[1] != q.shape[1],
        )
    return out.permute(2, 0, 1, 3)


class SelfAttention(torch.nn.Module):
    def __init__(self, config, *, tp_group, rng_tracker, cp_group=None, device=None):
        super().__init__()
        tp = dist.get_world_size(tp_group)
        self.config = config
        self.rng_tracker = rng_tracker
        self.cp_group = cp_group
        self.head_dim = config.kv_channels
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.local_groups = config.num_query_groups // tp
        qkv_size = config.num_query_groups * (self.heads_per_group + 2) * self.head_dim
        common = dict(
            tp_group=tp_group,
            bias=config.add_bias_linear,
            sequence_parallel=config.sequence_parallel,
            dtype=config.params_dtype,
            device=device,
            gradient_accumulation_fusion=config.gradient_accumulation_fusion,
        )
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size,
            qkv_size,
            init_std=config.init_method_std,
            **{**common, "bias": config.add_bias_linear or config.add_qkv_bias},
        )
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:  # one weight per channel shared by all heads: tp ranks hold different heads
            self.q_layernorm = Norm(config, self.head_dim, device, sum_grads_over_tp=True)
            self.k_layernorm = Norm(config, self.head_dim, device, sum_grads_over_tp=True)
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            init_std=config.output_layer_init_std,
            **common,
        )

    def _attend(self, q, k, v, attention_mask):
        dropout_p = self.config.attention_dropout if self.training else 0.0
        paths = self.config.kernel_paths(
            q.device.type,
            attention_dropout=dropout_p,
            context_parallel=self.cp_group is not None and dist.get_world_size(self.cp_group) > 1,
            document_mask=attention_mask is not None,
        )
        attend = functools.partial(
            core_attention, q, k, v, dropout_p, paths, self.cp_group, self.config.cp_comm_type, attention_mask
        )
        if dropout_p == 0.0:
            return attend()
        with self.rng_tracker.fork(tensor_parallel=True):
            return attend()

    def forward(self, x, rotary_angles=None, attention_mask=None):
        """`rotary_angles` [s, b or 1, 1, r]; `attention_mask`: `document_mask` or None (causal)."""
        qkv = self.linear_qkv(x)
        s, b = qkv.shape[:2]
        qkv = qkv.view(s, b, self.local_groups, self.heads_per_group + 2, self.head_dim)
        q = qkv[:, :, :, : self.heads_per_group].reshape(s, b, -1, self.head_dim)
        k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary_angles is not None:  # q and k in one call (kernels/rope.py; --no-rope-fusion: the torch path)
            impl = self.config.kernel_paths(q.device.type).rope.impl
            q, k = rope(q, k, rotary_angles, self.config.rotary_interleaved, impl=impl)
        if self.config.recompute_granularity == "selective":
            context = recompute(self._attend, self.rng_tracker, q, k, v, attention_mask)
        else:
            context = self._attend(q, k, v, attention_mask)
        return self.linear_proj(context.reshape(s, b, -1))
