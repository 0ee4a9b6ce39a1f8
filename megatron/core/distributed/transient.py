"""A flat tensor whose memory exists only while it is in use.

Views taken of it (parameters' `.data`, their `main_grad`) stay valid while its storage is
freed and allocated again, because they share the storage object, not its bytes: reading a
view while the storage is freed raises instead of returning stale values. This is how a
bucket's gathered parameters and its unsharded gradients come and go (optim_grads,
optim_grads_params) without re-pointing any parameter.
"""

from __future__ import annotations

import torch


class TransientBuffer:
    def __init__(self, numel: int, dtype: torch.dtype, device):
        """Allocated at first (views can only be taken then)."""
        self.data = torch.zeros(numel, dtype=dtype, device=device)
        self.nbytes = self.data.untyped_storage().nbytes()

    @property
    def allocated(self) -> bool:
        return self.data.untyped_storage().nbytes() == self.nbytes

    def allocate(self) -> bool:
        """Give the storage its bytes back (contents undefined); False when it already had them."""
        if self.allocated:
            return False
        self.data.untyped_storage().resize_(self.nbytes)
        return True

    def free(self) -> None:
        self.data.untyped_storage().resize_(0)
