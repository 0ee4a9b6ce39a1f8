"""The optimizer's view of this rank's buffers: one flat fp32 shard per bucket (memory chunk).

With the replicated optimizer a shard is a whole bucket; with the distributed optimizer it
is this rank's 1/(dp x cp) of it. A `FlatShard` holds views of the gradient and parameter
buffers, the fp32 master weights (a view of the parameter buffer when the weights are fp32,
else a copy), and per-parameter `ShardPiece`s (name -> shard slice and offset within the
flattened parameter) from which weight decay, the norm's counting and, later, checkpoints
by name are derived. State (Adam moments) is attached by the optimizer's middle part, which
may place each shard's state wherever it likes: an offloaded shard (`host_grad` set) keeps its
master weights in host memory and receives its gradient there (see `offload.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def weight_decay_applies(name: str) -> bool:
    """Decoupled weight decay for weights of linear layers and embeddings; none for biases and
    for the weights of normalisation layers (`...layernorm.weight`, `...final_layernorm.weight`).
    Decided by the fully qualified name, which is the same in every layout."""
    *owner, leaf = name.split(".")
    return leaf != "bias" and not (owner and owner[-1].endswith("norm"))


def is_embedding_or_output(name: str) -> bool:
    """The parameters Megatron's --decoupled-lr applies to: word embeddings and the output layer."""
    return name in ("embedding.word_embeddings.weight", "output_layer.weight")


def counts_in_grad_norm(param, mesh) -> bool:
    """Whether this rank's copy counts in the global norm: weights replicated across tp count on
    tp rank 0 only; the tied output-layer copy (on the last stage, or beside the embedding on rank 0
    under the V placement) not at all; expert weights on every rank (the ranks of an expert-tensor x
    expert-parallel group hold different pieces, their replicas are counted by `FlatShard.replicas`)."""
    if getattr(param, "tied_output_copy", False):
        return False
    if getattr(param, "is_expert", False):
        return True
    return getattr(param, "tensor_model_parallel", False) or mesh.tp_rank == 0


@dataclass
class FlatShard:
    main: torch.Tensor  # fp32 master weights of the shard
    grad: torch.Tensor  # fp32 view of the gradient buffer
    model: torch.Tensor  # view of the parameter buffer (model dtype)
    pieces: list  # ShardPiece per parameter (part) in the shard, in order
    decay: list  # (start, end) ranges that take weight decay
    counted: list  # (start, end) ranges that count in the global grad norm
    decoupled: list = ()  # (start, end) ranges of the embedding / output layer (--decoupled-lr)
    host_grad: torch.Tensor | None = None  # offloaded: the gradient's host copy (master is on host too)
    model_on_host: bool = False  # the parameter shard is host-resident (fetched when its bucket is gathered)
    replicas: int = 1  # ranks holding these same elements (the replicated optimizer's dp x cp, or expert dp)

    @property
    def grad_on_host(self) -> bool:
        """The gradient shard itself lives in host memory (it is its own host copy)."""
        return self.host_grad is not None and self.host_grad is self.grad

    @property
    def offloaded(self) -> bool:
        return self.host_grad is not None

    @property
    def aliased(self) -> bool:
        """fp32 weights are their own master: nothing to copy back after the step."""
        return self.main.data_ptr() == self.model.data_ptr()

    def views(self, tensor: torch.Tensor, ranges: list) -> list[torch.Tensor]:
        return [tensor[start:end] for start, end in ranges]


def build_shards(buffers: list, mesh, host_memory=None, offloaded=frozenset()) -> list[FlatShard]:
    """One FlatShard per bucket of each ParamAndGradBuffer, in buffer order. Shards whose index is
    in `offloaded` get their master weights and gradient copy from `host_memory`
    (distributed.host_memory.HostMemory), never on the device, not even for a moment; a
    host-resident gradient shard is its own host copy."""
    shards = []
    for buffer in buffers:
        for index, bucket in enumerate(buffer.buckets):
            pieces = buffer.layout.pieces(index, buffer.shard_rank)
            model = bucket.param_shard
            host = len(shards) in offloaded
            main = (
                host_memory.empty(model.numel()).copy_(model)
                if host
                else model
                if model.dtype == torch.float32
                else model.detach().float()
            )
            ranges = [(p.shard_start, p.shard_end) for p in pieces]
            shards.append(
                FlatShard(
                    main=main,
                    grad=bucket.grad_shard,
                    model=model,
                    pieces=pieces,
                    decay=[r for p, r in zip(pieces, ranges) if weight_decay_applies(p.name)],
                    counted=[r for p, r in zip(pieces, ranges) if counts_in_grad_norm(buffer.params[p.name], mesh)],
                    decoupled=[r for p, r in zip(pieces, ranges) if is_embedding_or_output(p.name)],
                    host_grad=(bucket.grad_shard if bucket.grads_on_host else host_memory.empty(model.numel()))
                    if host
                    else None,
                    model_on_host=bucket.params_on_host,
                    replicas=bucket.group_size // buffer.layout.shards,
                )
            )
    return shards
