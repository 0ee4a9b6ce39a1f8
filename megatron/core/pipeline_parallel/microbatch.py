"""What the executors read for one microbatch."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Microbatch(NamedTuple):
    """One microbatch on one rank, each tensor [b, s] (a cp rank's share of the sequence).

    `position_ids` and `document_ids` are set only with --reset-position-ids and
    --reset-attention-mask. Rotary angles and the document mask are applied in every layer,
    so then every pipeline stage reads the microbatch, not only the first and the last.
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None

    def model_inputs(self) -> dict:
        """Keyword inputs of every model chunk's forward: the per-sample positions and documents present."""
        return {name: value for name in ("position_ids", "document_ids") if (value := getattr(self, name)) is not None}
