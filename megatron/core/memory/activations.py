"""Bytes autograd keeps for backward, per model chunk and microbatch, derived from our layers.

Every tensor a layer saves is registered in a `Ledger` under a tag naming its
storage, so a storage saved by several ops (a view of the QKV output used as q, k
and v; the residual stream used by a norm) is counted once -- the same rule the
measurement applies (unique storages seen by `saved_tensors_hooks`, parameters
excluded). What each op saves follows megatron/core/transformer/* and the kernel
choices documented in megatron/core/memory/kernels.py. Sizes per microbatch
(b = micro batch, s = sequence on this cp rank, t = tp, p = weight bytes):

- the residual stream is [s/t, b, h] under sequence parallelism, else [s, b, h];
- column-parallel layers save their input as it arrives: the norm output, a
  sequence shard [s/t, b, h] under SP (the layer gathers it again in backward,
  as Megatron does), else [s, b, h];
- QKV output [s, b, (a + 2g) d / t]; attention per `KernelChoice.attention`;
  output-projection input [s, b, a d / t]; MLP: fc1 output, (SwiGLU: silu output),
  fc2 input; hidden dropout saves a mask of the residual's size;
- first stage: token ids (int64), embedding dropout mask, and the model's positions
  buffer (int64 [s], learned positions only), one storage shared by every microbatch
  and so counted once per rank (`shared_bytes`); the chunk input (embedding output, or the p2p-received tensor, which the executor holds
  until the chunk's backward whether or not a layer saves it);
- last stage: final norm, output-layer input, the vocab-parallel cross entropy's
  fp32 softmax [s, b, V/t], targets (int64) and mask (bool), and the executor's
  loss mask [b, s] (fp32; the masked loss sum is scaled by a Python number).
Recomputation: a fully recomputed group keeps only its input (what torch.utils.checkpoint
saves); selective recomputation keeps q, k, v (the recomputed core
attention's inputs) and the attention output.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from megatron.core.memory.kernels import KernelChoice, dtype_bytes
from megatron.core.memory.parameters import ModelChunk, padded_vocab

INT64, BOOL, FP32 = 8, 1, 4


class Ledger:
    """Saved storages by tag; saving a tag twice counts it once."""

    def __init__(self):
        self.saved: dict[str, int] = {}

    def save(self, tag: str, nbytes: int) -> None:
        if self.saved.setdefault(tag, nbytes) != nbytes:
            raise AssertionError(f"storage {tag!r} registered with two sizes")

    @property
    def total(self) -> int:
        return sum(self.saved.values())


@dataclass(frozen=True)
class Dims:
    """Per-microbatch sizes on one rank."""

    b: int
    s: int        # sequence on this cp rank (full over tp)
    s_res: int    # rows of the residual stream: s / tp under sequence parallelism
    h: int
    heads: int    # local attention heads
    groups: int   # local query groups
    d: int
    ffn: int      # local ffn width
    vocab: int    # local padded vocabulary
    p: int        # weight bytes
    sp: bool
    tp: int

    @classmethod
    def of(cls, config, layout) -> "Dims":
        tp, s = layout.tp, config.seq_length // layout.cp
        sp = config.sequence_parallel and tp > 1
        return cls(b=layout.micro_batch_size, s=s, s_res=s // tp if sp else s, h=config.hidden_size,
                   heads=config.num_attention_heads // tp, groups=config.num_query_groups // tp,
                   d=config.kv_channels, ffn=config.ffn_hidden_size // tp, vocab=padded_vocab(config, tp) // tp,
                   p=dtype_bytes(config.params_dtype), sp=sp, tp=tp)

    @property
    def residual_bytes(self) -> int:
        return self.s_res * self.b * self.h * self.p


@dataclass
class ModelChunkActivations:
    bytes: int                    # one microbatch
    shared_bytes: int             # storages every microbatch of the chunk saves (counted once while any is alive)
    recompute_working_bytes: int  # one recomputed group (or core attention) re-materialised in backward
    items: dict = field(default_factory=dict)


def recompute_groups(config, n_layers: int) -> list[tuple[int, int, bool]]:
    """(start, end, recomputed?) of the layer groups, as TransformerBlock._recomputed_groups runs them."""
    if config.recompute_granularity != "full":
        return [(0, n_layers, False)]
    n = config.recompute_num_layers
    if config.recompute_method == "uniform":
        return [(start, min(start + n, n_layers), True) for start in range(0, n_layers, n)]
    return [(i, i + 1, i < n) for i in range(n_layers)]


class ActivationModel:
    def __init__(self, config, layout, kernels: KernelChoice):
        self.config, self.layout, self.k = config, layout, kernels
        self.dims = Dims.of(config, layout)

    # ------------------------------------------------------------------ pieces
    def _norm(self, led: Ledger, name: str, x_tag: str) -> str:
        d, cfg = self.dims, self.config
        rows = d.s_res * d.b
        layer_norm = cfg.normalization == "LayerNorm"
        if self.k.norm == "triton":  # saves x and fp32 statistics
            led.save(x_tag, d.residual_bytes)
            led.save(f"{name}.rstd", rows * FP32)
            if layer_norm:
                led.save(f"{name}.mean", rows * FP32)
            return f"{name}.out"
        # torch reference: x and the weights upcast to fp32 (copies unless fp32), then F.layer_norm / F.rms_norm
        x32 = x_tag if d.p == FP32 else f"{name}.x_fp32"
        led.save(x32, rows * d.h * FP32)
        led.save(f"{name}.rstd", rows * FP32)
        if d.p != FP32:
            for weight in ("weight", "bias") if layer_norm else ("weight",):
                led.save(f"{name}.{weight}_fp32", d.h * FP32)
        if layer_norm:
            led.save(f"{name}.mean", rows * FP32)
        elif self.k.torch_rms_norm == "composite":  # the normalised x that multiplies the weight
            led.save(f"{name}.normalized", rows * d.h * FP32)
        return f"{name}.out"

    def _column_input(self, led: Ledger, norm_out: str) -> None:
        d = self.dims
        led.save(norm_out, d.s_res * d.b * d.h * d.p)

    def _dropout(self, led: Ledger, name: str) -> None:
        if self.config.hidden_dropout > 0.0:
            d = self.dims
            led.save(name, d.s_res * d.b * d.h * self.k.dropout_mask_bytes)

    def _attention(self, led: Ledger, i: int, selective: bool) -> int:
        """Saves of the attention block; returns the core attention's bytes when it is recomputed."""
        d, cfg, k = self.dims, self.config, self.k
        sb = d.s * d.b
        rope = cfg.position_embedding_type == "rope"
        qkv = (f"{i}.qkv", sb * (d.heads + 2 * d.groups) * d.d * d.p)
        q_is_view = d.groups == 1 or d.heads == d.groups
        q = (f"{i}.q_rot", sb * d.heads * d.d * d.p) if rope else \
            qkv if q_is_view else (f"{i}.q", sb * d.heads * d.d * d.p)
        kk = (f"{i}.k_rot", sb * d.groups * d.d * d.p) if rope else qkv
        if rope:  # cos and sin [s, 1, 1, d] in fp32, computed for q and for k
            for name in ("q.cos", "q.sin", "k.cos", "k.sin"):
                led.save(f"{i}.rope.{name}", d.s * d.d * FP32)
        inner = Ledger() if selective else led
        if selective:
            for tag, nbytes in (q, kk, qkv):
                led.save(tag, nbytes)
        n = d.b * d.heads
        if k.attention == "triton":  # contiguous copies of q, k, v, the output, the log-sum-exp
            inner.save(f"{i}.q_contiguous", sb * d.heads * d.d * d.p)
            for name in ("k", "v"):
                inner.save(f"{i}.{name}_contiguous", sb * d.groups * d.d * d.p)
            inner.save(f"{i}.kernel_out", sb * d.heads * d.d * d.p)
            inner.save(f"{i}.lse", n * d.s * FP32)
        elif k.attention == "ring":  # q, k, v as given (views), its output and the fp32 log-sum-exp
            for tag, nbytes in (q, kk, qkv):
                inner.save(tag, nbytes)
            inner.save(f"{i}.kernel_out", sb * d.heads * d.d * d.p)
            inner.save(f"{i}.lse", n * d.s * FP32)
        elif k.attention in ("flash", "efficient"):
            for tag, nbytes in (q, kk, qkv):
                inner.save(tag, nbytes)
            lse_len = d.s if k.attention == "flash" else math.ceil(d.s / 32) * 32
            inner.save(f"{i}.lse", n * lse_len * FP32)
        else:
            c = k.attention_math_bytes
            inner.save(f"{i}.q_scaled", n * d.s * d.d * c)
            inner.save(f"{i}.k_scaled", n * d.s * d.d * c)
            inner.save(f"{i}.probs", n * d.s * d.s * c)
            if cfg.attention_dropout > 0.0:
                mask = 1 if k.dropout_mask_bytes == 1 else c
                inner.save(f"{i}.probs_mask", n * d.s * d.s * mask)
                inner.save(f"{i}.probs_dropped", n * d.s * d.s * c)
            if d.heads == d.groups and c == d.p:
                inner.save(*qkv)
            else:
                inner.save(f"{i}.v_copy", n * d.s * d.d * c)
        # the output projection's input: a view of the SDPA flash output, a copy of the math path's; the
        # Triton and ring outputs reshape to a non-contiguous view that the projection saves as it is (its
        # weight is in a gradient buffer, so it runs through tensor_parallel.layers._Linear, not autograd's
        # linear, which would save a folded copy)
        led.save(f"{i}.kernel_out" if k.attention in ("triton", "ring") else f"{i}.attn_out", sb * d.heads * d.d * d.p)
        return inner.total if selective else 0

    def layer(self, led: Ledger, i: int, x_tag: str) -> tuple[str, int]:
        """Saves of global layer i whose input is `x_tag`; returns (output tag, recompute bytes)."""
        d, cfg = self.dims, self.config
        self._column_input(led, self._norm(led, f"{i}.ln1", x_tag))
        core = self._attention(led, i, cfg.recompute_granularity == "selective")
        self._dropout(led, f"{i}.drop1")
        self._column_input(led, self._norm(led, f"{i}.ln2", f"{i}.mid"))
        sb = d.s * d.b
        led.save(f"{i}.fc1_out", sb * (2 if cfg.swiglu else 1) * d.ffn * d.p)
        if cfg.swiglu:
            led.save(f"{i}.silu", sb * d.ffn * d.p)
        led.save(f"{i}.fc2_in", sb * d.ffn * d.p)
        self._dropout(led, f"{i}.drop2")
        return f"{i}.out", core

    def embedding(self, led: Ledger, shared: Ledger) -> str:
        d = self.dims
        if d.tp == 1:
            led.save("ids", d.b * d.s * INT64)
        else:  # vocab-parallel lookup saves the shifted, masked ids and the out-of-range mask
            led.save("ids_local", d.s * d.b * INT64)
            led.save("ids_outside", d.s * d.b * BOOL)
        if self.config.position_embedding_type == "learned_absolute":  # a view of the positions buffer
            shared.save("positions", d.s * INT64)
        self._dropout(led, "embedding.dropout")
        return "chunk_input"

    def head(self, led: Ledger, x_tag: str) -> None:
        d = self.dims
        self._column_input(led, self._norm(led, "final_norm", x_tag))
        led.save("softmax", d.s * d.b * d.vocab * FP32)
        led.save("target", d.s * d.b * INT64)
        led.save("target_outside", d.s * d.b * BOOL)
        led.save("loss_mask", d.b * d.s * FP32)

    # ------------------------------------------------------------------ a chunk
    def chunk(self, chunk: ModelChunk) -> ModelChunkActivations:
        led, shared = Ledger(), Ledger()
        if chunk.pre_process:
            x = self.embedding(led, shared)
        else:
            x = "chunk_input"
            led.save(x, self.dims.residual_bytes)
        working = 0
        ids = chunk.layer_ids
        for start, end, recomputed in recompute_groups(self.config, len(ids)):
            if recomputed:
                group_input = x
                led.save(group_input, self.dims.residual_bytes)  # the recomputed group.s saved input
                scratch = Ledger()
                for i in ids[start:end]:
                    x, _ = self.layer(scratch, i, x)
                scratch.saved.pop(group_input, None)
                working = max(working, scratch.total)
                continue
            for i in ids[start:end]:
                x, core = self.layer(led, i, x)
                working = max(working, core)
        if chunk.post_process:
            self.head(led, x)
        return ModelChunkActivations(bytes=led.total, shared_bytes=shared.total, recompute_working_bytes=working,
                                     items=dict(led.saved))
