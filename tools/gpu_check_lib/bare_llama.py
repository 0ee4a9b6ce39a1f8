"""The bare PyTorch baseline: a plain nn.Module Llama (RMSNorm, rotary positions, SDPA with GQA,
SwiGLU, untied output layer) trained with fp32 weights under bf16 autocast, gradient clipping and
torch.optim.AdamW(fused=True): what a user would write without this framework."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, groups: int, ffn: int):
        super().__init__()
        self.heads, self.groups, self.head_dim = heads, groups, hidden // heads
        self.norm1, self.norm2 = nn.RMSNorm(hidden, eps=1e-5), nn.RMSNorm(hidden, eps=1e-5)
        self.qkv = nn.Linear(hidden, (heads + 2 * groups) * self.head_dim, bias=False)
        self.proj = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        d = self.head_dim
        q, k, v = self.qkv(self.norm1(x)).split([self.heads * d, self.groups * d, self.groups * d], dim=-1)
        q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v))
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # the projections' dtype (bf16 under autocast)
        out = F.scaled_dot_product_attention(
            _rotate(q, cos, sin), _rotate(k, cos, sin), v, is_causal=True, enable_gqa=self.heads != self.groups
        )
        x = x + self.proj(out.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class BareLlama(nn.Module):
    def __init__(self, model):
        """`model`: our TransformerConfig (only its sizes are read)."""
        super().__init__()
        h, heads = model.hidden_size, model.num_attention_heads
        self.embedding = nn.Embedding(model.padded_vocab_size, h)
        self.layers = nn.ModuleList(
            Block(h, heads, model.num_query_groups, model.ffn_hidden_size) for _ in range(model.num_layers)
        )
        self.norm = nn.RMSNorm(h, eps=1e-5)
        self.output = nn.Linear(h, model.padded_vocab_size, bias=False)
        d = h // heads
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
        angles = torch.outer(torch.arange(model.seq_length).float(), inv_freq).repeat(1, 2)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens, labels):
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


class BareLoop:
    """One training step = `microbatches` forward/backward passes, clip, AdamW(fused=True)."""

    def __init__(self, run, device: torch.device):
        torch.manual_seed(run.training.seed)
        model, opt = run.model, run.optimizer
        self.device = device
        with device:  # initialised on the device (the host takes seconds for a billion weights)
            self.model = BareLlama(model)
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        rest = [p for p in self.model.parameters() if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": opt.weight_decay}, {"params": rest, "weight_decay": 0.0}],
            lr=opt.lr,
            betas=(opt.adam_beta1, opt.adam_beta2),
            eps=opt.adam_eps,
            fused=True,
        )
        self.clip, self.microbatches = opt.clip_grad, run.training.num_microbatches
        shape = (run.training.micro_batch_size, model.seq_length)
        self.tokens = torch.randint(0, model.vocab_size, shape, device=device)
        self.labels = torch.randint(0, model.vocab_size, shape, device=device)

    def step(self) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for _ in range(self.microbatches):
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                loss = self.model(self.tokens, self.labels) / self.microbatches
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total
