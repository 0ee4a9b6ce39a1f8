"""What the GPU check registers in torchtitan 0.2.2 through its `--experimental.custom_import` hook (torchtitan
imports this module by name before it builds anything): a train spec `TRAIN_SPEC_NAME`, torchtitan's own Llama-3
model, parallelization, optimizer, scheduler and loss, with two things torchtitan does not ship:

- flavors of Llama-3-8B with fewer layers, named `8B-L<layers>` (hidden 4096, 32 heads, 8 KV heads, SwiGLU
  14336 from torchtitan's own 1.3 multiplier rounded to 1024, vocabulary 128256, rope theta 500000) and, for a dry
  run, `dry-L<layers>` (the tiny shape of throughput_jobs.DRY_SHAPE);
- a synthetic-token dataset: uniform random token ids from a fixed seed, no tokenizer (torchtitan 0.2.2 has no mock
  data), batched by torchtitan's own `ParallelAwareDataloader`.

Imported only where torchtitan is importable (tools/gpu_check_lib/torchtitan_rows.py puts its wheels on the path).
"""

from __future__ import annotations

import re

import torch
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.models import llama3
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.protocols.train_spec import TrainSpec, register_train_spec

TRAIN_SPEC_NAME = "gpu_check_llama3"
FLAVOR = re.compile(r"^(8B|dry)-L(\d+)$")
SHAPES = {
    "8B": dict(dim=4096, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3, multiple_of=1024, vocab_size=128256),
    # hidden 64, 4 heads, 2 KV groups, ffn 128: torchtitan's int(2 * 4 * 64 / 3) = 170, x 0.75 = 127, rounded up to 128
    "dry": dict(dim=64, n_heads=4, n_kv_heads=2, ffn_dim_multiplier=0.75, multiple_of=128, vocab_size=256),
}


class Flavors(dict):
    """torchtitan reads `model_args[flavor]`: any `8B-L<n>` or `dry-L<n>` is built on first use."""

    def __missing__(self, flavor: str) -> TransformerModelArgs:
        match = FLAVOR.match(flavor)
        if match is None:
            raise KeyError(f"{flavor!r}: this train spec's flavors are 8B-L<layers> and dry-L<layers>")
        args = TransformerModelArgs(n_layers=int(match.group(2)), rope_theta=500000, **SHAPES[match.group(1)])
        self[flavor] = args
        return args


class SyntheticTokens(IterableDataset):
    """Endless samples of `seq_len` + 1 uniform random token ids: input the first `seq_len`, labels the last."""

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed)
        while True:
            sample = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=generator)
            yield {"input": sample[:-1]}, sample[1:]


def build_synthetic_dataloader(dp_world_size: int, dp_rank: int, tokenizer, job_config, **kwargs):
    """torchtitan's `build_dataloader_fn` signature; `tokenizer` is None (the spec has none)."""
    del tokenizer, kwargs
    vocab = TRAIN_SPEC.model_args[job_config.model.flavor].vocab_size
    dataset = SyntheticTokens(vocab, job_config.training.seq_len, seed=1234 + dp_rank)
    return ParallelAwareDataloader(
        dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=job_config.training.local_batch_size
    )


def _train_spec() -> TrainSpec:
    spec = llama3.get_train_spec()
    return TrainSpec(
        model_cls=spec.model_cls,
        model_args=Flavors(),
        parallelize_fn=spec.parallelize_fn,
        pipelining_fn=spec.pipelining_fn,
        build_optimizers_fn=spec.build_optimizers_fn,
        build_lr_schedulers_fn=spec.build_lr_schedulers_fn,
        build_dataloader_fn=build_synthetic_dataloader,
        build_tokenizer_fn=None,
        build_loss_fn=spec.build_loss_fn,
    )


TRAIN_SPEC = _train_spec()
register_train_spec(TRAIN_SPEC_NAME, TRAIN_SPEC)
