"""GPTModel: embedding -> transformer block -> output layer -> vocab-parallel loss.

GPT and Llama are configurations of this one model (see TransformerConfig). A
pipeline stage builds the same class with `pre_process` (embedding, first stage),
`post_process` (final norm, output layer and loss, last stage) and the global
indices of its layers; parameter names are identical in every layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron.core.context_parallel.sharding import positions as cp_positions
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.fused_cross_entropy import OutputLayer
from megatron.core.tensor_parallel.initialization import InitSpec, make_param
from megatron.core.tensor_parallel.layers import VocabParallelEmbedding
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.attention import document_mask
from megatron.core.transformer.block import TransformerBlock
from megatron.core.transformer.layer import hidden_dropout
from megatron.core.transformer.rotary import rotary_frequencies

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"


class LanguageModelEmbedding(torch.nn.Module):
    """Token embeddings (vocab-parallel) plus optional learned absolute positions."""

    def __init__(self, config, *, tp_group, rng_tracker, device=None):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.rng_tracker = rng_tracker
        self.word_embeddings = VocabParallelEmbedding(
            config.padded_vocab_size,
            config.hidden_size,
            tp_group=tp_group,
            init_std=config.init_method_std,
            vocab_size=config.vocab_size,
            dtype=config.params_dtype,
            device=device,
        )
        self.position_embeddings = None
        if config.position_embedding_type == "learned_absolute":
            self.position_embeddings = torch.nn.Embedding(
                config.max_position_embeddings, config.hidden_size, dtype=config.params_dtype, device=device
            )
            shape = (config.max_position_embeddings, config.hidden_size)
            self.position_embeddings.weight = make_param(
                shape,
                InitSpec(shape, std=config.init_method_std),
                config.params_dtype,
                device,
                sequence_parallel=config.sequence_parallel,
            )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids [b, s] -> hidden states [s, b, h] (a sequence shard [s/tp, b, h] under SP).
        `positions` [s, b or 1]: the positions of these tokens (a cp rank's share of the sequence)."""
        partial = self.word_embeddings(input_ids.t())
        if self.config.sequence_parallel:
            hidden = reduce_scatter_to_sequence_parallel_region(partial, self.tp_group)
        else:
            hidden = reduce_from_tensor_parallel_region(partial, self.tp_group)
        if self.position_embeddings is not None:
            local_s = hidden.shape[0]
            start = dist.get_rank(self.tp_group) * local_s if self.config.sequence_parallel else 0
            hidden = hidden + self.position_embeddings(positions[start : start + local_s])
        return hidden_dropout(
            hidden, self.config.hidden_dropout, self.training, self.rng_tracker, self.config.sequence_parallel
        )


class GPTModel(torch.nn.Module):
    def __init__(
        self,
        config,
        *,
        tp_group,
        rng_tracker,
        layer_ids=None,
        pre_process: bool = True,
        post_process: bool = True,
        cp_group=None,
        expert_groups=None,
        device=None,
    ):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.pre_process, self.post_process = pre_process, post_process
        self.tied = not config.untie_embeddings_and_output_weights
        layer_ids = list(range(config.num_layers)) if layer_ids is None else list(layer_ids)
        if pre_process:
            self.embedding = LanguageModelEmbedding(config, tp_group=tp_group, rng_tracker=rng_tracker, device=device)
        self.decoder = TransformerBlock(
            config,
            layer_ids,
            tp_group=tp_group,
            rng_tracker=rng_tracker,
            post_process=post_process,
            cp_group=cp_group,
            expert_groups=expert_groups,
            device=device,
        )
        if post_process:
            self.output_layer = OutputLayer(
                config.hidden_size,
                config.padded_vocab_size,
                tp_group=tp_group,
                bias=False,
                init_std=config.init_method_std,
                sequence_parallel=config.sequence_parallel,
                dtype=config.params_dtype,
                device=device,
                skip_weight=self.tied and pre_process,
                real_rows=config.vocab_size,
                weight_seed_name=WORD_EMBEDDINGS if self.tied else None,
                gradient_accumulation_fusion=config.gradient_accumulation_fusion,
                split_backward_defers=False,
            )
            if self.tied and not pre_process:
                self.output_layer.weight.shared_embedding = True
                self.output_layer.weight.tied_output_copy = True  # the embedding's copy: one gradient, counted once
        if self.tied and pre_process and not post_process:
            self.embedding.word_embeddings.weight.shared_embedding = True
        # the global positions of this rank's tokens: all of them, or a cp rank's load-balanced share
        cp_size, cp_rank = (dist.get_world_size(cp_group), dist.get_rank(cp_group)) if cp_group else (1, 0)
        self.register_buffer(
            "positions", cp_positions(config.seq_length, cp_rank, cp_size, device=device), persistent=False
        )
        table = None  # [s, r]: the rotary angles of positions 0..s-1, looked up per token
        if config.position_embedding_type == "rope":
            table = rotary_frequencies(
                config.seq_length,
                config.rotary_dim,
                config.rotary_base,
                device=device,
                interleaved=config.rotary_interleaved,
                scaling_factor=config.rope_scaling_factor if config.rope_scaling else None,
            )[:, 0, 0]
        self.register_buffer("rotary_table", table, persistent=False)

    def output_weight(self) -> torch.Tensor:
        if self.tied and self.pre_process:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight

    def forward(
        self,
        inputs: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """inputs: token ids [b, s] on the first stage, else hidden states [s, b, h].

        `position_ids` [b, s] (--reset-position-ids): each token's position, for rotary angles
        or learned position embeddings (None: the positions in the sequence); `document_ids`
        [b, s] (--reset-attention-mask): tokens attend only within their document (None: the
        whole sample). Both are this rank's share of the sequence, like the tokens. `loss_mask` [b, s]:
        the weights of the loss that will be backpropagated (sum of mask x per-token loss, times any
        scalar), which --cross-entropy-loss-fusion needs in the forward (fused_cross_entropy.py; None:
        all ones); the unfused path leaves the masking to the caller.
        Returns hidden states (not the last stage), the per-token loss [b, s] in fp32
        (last stage, labels given), or the full logits [b, s, vocab] (labels None).
        """
        positions = self.positions[:, None] if position_ids is None else position_ids.t()  # [s, b or 1]
        hidden = self.embedding(inputs, positions) if self.pre_process else inputs
        angles = None if self.rotary_table is None else self.rotary_table[positions][:, :, None]
        mask = None if document_ids is None else document_mask(document_ids)
        hidden = self.decoder(hidden, angles, mask)
        if not self.post_process:
            return hidden
        if labels is not None and self.config.cross_entropy_loss_fusion:
            impl = self.config.kernel_paths(hidden.device.type).cross_entropy.impl
            once = not (self.tied and self.pre_process)  # a tied embedding's gradient also comes from its lookup
            mask = None if loss_mask is None else loss_mask.t()
            return self.output_layer(hidden, self.output_weight(), labels.t(), impl, once, mask).t()
        logits = self.output_layer(hidden, self.output_weight())
        if labels is None:
            full = gather_from_tensor_parallel_region(logits, self.tp_group)
            return full[..., : self.config.vocab_size].transpose(0, 1)
        vocab_start = dist.get_rank(self.tp_group) * logits.shape[-1]
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.tp_group, vocab_start)
        return loss.t()
