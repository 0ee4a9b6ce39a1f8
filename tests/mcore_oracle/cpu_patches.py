"""Redirect megatron-core 0.16.1's CUDA-only calls to the CPU (import before megatron.core).

Runs only in the megatron-core virtual environment. What is redirected and why:
- `torch.cuda.current_device()` names the device new tensors go to: "cpu".
- The RNG tracker saves, seeds and restores the CUDA generator: the CPU generator instead.
- Two causal-mask helpers allocate on "cuda": the same masks on the CPU.
- The checkpoint writer calls `torch.cuda.synchronize()`: nothing to wait for.
- MoE: the router's gating reads TransformerEngine's gemm, a name megatron-core leaves undefined without TE
  (None selects its torch path); the alltoall dispatcher copies split sizes to the host on a CUDA side stream
  (on the CPU they are there already).
- A few constructors (the FP32 optimizer's loss scale, ...) pass device="cuda" or call
  `.cuda()`, and the gradient clipping asserts `grad.type() == 'torch.cuda.FloatTensor'`: a
  torch-function mode, entered for the whole process, keeps those tensors on the CPU and names
  CPU tensor types as their CUDA counterparts.
"""

import torch
from torch.overrides import TorchFunctionMode


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:  # asserts of 'torch.cuda.FloatTensor'
            return func(*args).replace("torch.", "torch.cuda.", 1)
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


_CudaToCpu().__enter__()

torch.cuda.current_device = lambda: "cpu"
torch.cuda.synchronize = lambda *args, **kwargs: None
torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
torch.cuda.manual_seed_all = lambda seed: None

import megatron.core.fusions.fused_softmax as mcore_fused_softmax  # noqa: E402
import megatron.core.tensor_parallel.random as mcore_random  # noqa: E402
import megatron.core.transformer.utils as mcore_transformer_utils  # noqa: E402

mcore_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
mcore_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)


def _causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _sliding_window_mask(sq: int, skv: int, window_size) -> torch.Tensor:
    m = torch.ones(sq, skv, dtype=torch.bool)
    return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])


for module in (mcore_transformer_utils, mcore_fused_softmax):
    module.get_default_causal_mask = _causal_mask
    module.get_sliding_window_causal_mask = _sliding_window_mask


import megatron.core.transformer.moe.moe_utils as mcore_moe_utils  # noqa: E402
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher  # noqa: E402

mcore_moe_utils.te_general_gemm = None


def _splits_to_host(self, point, tokens_per_expert=None):
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            if isinstance(getattr(self, name), torch.Tensor):
                setattr(self, name, getattr(self, name).numpy())
    return tokens_per_expert


MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "no CUDA stream on the CPU"
MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _splits_to_host
