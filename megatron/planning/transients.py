"""Memory that exists only for a while: communication buffers, the largest temporary, allowances.

Unlike parameters, gradients, optimizer state and saved activations (exact and
checked against measurement on CPU), these are estimates from the shapes our
code allocates and are NOT validated by measurement yet:

- p2p: buffers of the pipeline executor over the schedule (`inflight.walk`), the
  amount they add on top of the activation peak;
- split backward (--split-backward): the output gradients that the linear layers
  of one model chunk queue for its weight step, counted whole on top of that
  microbatch's activations (which backward frees meanwhile: an upper bound);
- tp: one [s, b, h] buffer of a tensor-parallel collective (the copy the
  all-reduce makes, or the gathered gradient in backward);
- MoE dispatch: two [rows, h] tensors of the token dispatcher that are not saved (the permuted
  rows sent and those received by alltoall, the group's gathered tokens and the summed output
  with allgather, and their gradients in backward), at the balanced load (`moe_dispatch_bytes`);
- dp buckets: 0 extra bytes -- our GradBuffer reduces bucket views of `main_grad`
  in place (NCCL's own buffers are an allowance, below);
- the largest temporary during forward/backward, the max of: the last stage's
  logits (and their fp32 copy in the cross entropy when they are bf16/fp16; with
  --cross-entropy-loss-fusion one chunk's, beside the input gradient the chunks fill), a
  weight gradient before it is added to `main_grad` (the largest parameter's that has one:
  parameters.py `weight_gradient_shapes`, none of a linear layer's own weight with gradient
  accumulation fusion; two of them for an embedding tied within one stage: the output layer's
  gradient waits for the embedding's), the MLP's activation gradients (an MoE layer's: its local experts' rows at
  the balanced load), and the recomputed activations of one recomputed group;
- after backward (a separate phase: activations are gone): the optimizer step's
  temporaries, and the concatenated tied-embedding gradient all-reduced between
  the first and last stage;

The uncertain part, by name (`Transients.allowances`): what the trace cannot see, the only margin
the fit rule keeps (fit_rule.py). Assumptions, not measurements (none on GPU yet):
- fragmentation: a fixed fraction of the dynamic memory (activations + transients) for the
  CUDA caching allocator's rounding and unusable free blocks (0 on CPU);
- runtime: what a CUDA training process holds outside torch's allocator (the CUDA context with the
  kernels it loads, the libraries' handles and their own device memory): measured, 3.86 GiB in one
  process of our trainer on an H200 (`CUDA_RUNTIME_BYTES`; 0 on CPU);
- NCCL buffers: `communicator_bytes` for each communicator the rank runs collectives on
  (communicators.py; 0 on CPU, where gloo keeps no device buffers);
- document mask: the [b, 1, s, s] bool mask GPTModel builds from the document ids under
  --reset-attention-mask (attention.document_mask), one per microbatch-chunk in flight, as
  the layers' attention keeps it for backward; the trace runs without document ids;
- MoE routing imbalance: the saved activations that uneven routing adds to the balanced load
  the trace assumes (moe_routing.py), named with its assumption; the estimator traces it.
- context parallelism (cp > 1), each by name, none measured on a GPU (issue 41: Megatron-LM ran out of
  memory on layouts whose estimate put these in the allocator-visible peak at 87-99% of the device):
  the K/V blocks and fp32 accumulators of the ring or all-gather attention's backward
  (`cp_attention_bytes`, derived from ring_attention.py, on every device); on CUDA also the
  attention kernels' per-step outputs kept across the ring (`cp_workspace_bytes`), the ring's p2p
  NCCL connections to its two neighbours (`communicator_bytes` each, beside the cp communicator's
  collective buffers) and a fixed `CP_UNMEASURED_BYTES` for what else the attention library and the
  ring allocate (docs/memory.md, "Context parallelism's allowances": how it was sized).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.tensor_parallel.fused_cross_entropy import chunk_tokens
from megatron.core.transformer.moe.token_dispatcher import allgather_row_bound
from megatron.planning.kernels import dtype_bytes
from megatron.planning.moe_routing import routes_per_expert
from megatron.planning.parameters import padded_vocab

FP32 = 4
FRAGMENTATION_FRACTION = 0.10
# What one CUDA training process of ours held outside torch's caching allocator: 3.86 GiB (the
# process's 138.61 GiB in CUDA's out-of-memory message less 134.39 allocated and 0.36 reserved by
# PyTorch; H200, torch 2.11.0+cu130, one process, no NCCL communicator; docs/gpu-check.md, 2026-11-28).
# The only reading of our own stack, and the largest we have (Megatron-LM #525: 1.21 GiB on a V100 with
# torch 2.0.1), so it stands for every CUDA device: an allowance, not a derivation
CUDA_RUNTIME_BYTES = round(3.86 * (1 << 30))
# NCCL's buffers per communicator: "about 0.5 GB", the figure Fujii et al.'s later estimator adds
# per communicator on GPUs (as issue 36 quotes it; not measured here), taken as 0.5 GiB
NCCL_COMMUNICATOR_BYTES = 1 << 29
# Context parallelism's unmeasured rest (the attention library's workspaces, the ring's and the
# all-gather's buffers beyond ours, their fragmentation): not measured on a GPU; sized from issue 41's
# boundary (docs/memory.md, "Context parallelism's allowances"): 4 GiB
CP_UNMEASURED_BYTES = 4 << 30


@dataclass(frozen=True)
class Dims:
    """Per-microbatch sizes on one rank, for the formulas below."""

    b: int
    s: int  # sequence on this cp rank (full over tp)
    s_res: int  # rows of the residual stream: s / tp under sequence parallelism
    h: int
    heads: int  # local attention heads
    groups: int  # local query groups
    d: int
    ffn: int  # local ffn width
    vocab: int  # local padded vocabulary
    p: int  # weight bytes
    sp: bool
    tp: int

    @classmethod
    def of(cls, config, layout) -> Dims:
        tp, s = layout.parallel.tp, config.seq_length // layout.parallel.cp
        sp = config.sequence_parallel and tp > 1
        return cls(
            b=layout.micro_batch_size,
            s=s,
            s_res=s // tp if sp else s,
            h=config.hidden_size,
            heads=config.num_attention_heads // tp,
            groups=config.num_query_groups // tp,
            d=config.kv_channels,
            ffn=config.ffn_hidden_size // tp,
            vocab=padded_vocab(config, tp) // tp,
            p=dtype_bytes(config.params_dtype),
            sp=sp,
            tp=tp,
        )

    @property
    def residual_bytes(self) -> int:
        return self.s_res * self.b * self.h * self.p


@dataclass(frozen=True)
class Transients:
    p2p_bytes: int
    split_backward_bytes: int
    tp_bytes: int
    cp_bytes: int
    dp_bucket_bytes: int
    largest_temporary_bytes: int
    largest_temporary: str
    fragmentation_bytes: int
    runtime_bytes: int
    communicators: tuple[str, ...]  # communicators.py: the groups whose NCCL buffers are counted
    communicator_bytes: int  # all of them
    mask_bytes: int  # document masks of --reset-attention-mask
    moe_dispatch_bytes: int = 0
    moe_imbalance_bytes: int = 0  # saved activations uneven routing adds (moe_routing.py)
    moe_imbalance: str = ""  # the allowance's name, with its assumption
    cp_workspace_bytes: int = 0  # context parallelism's allowances (module docstring)
    cp_p2p_bytes: int = 0
    cp_unmeasured_bytes: int = 0

    def derived(self) -> dict[str, int]:
        """The parts derived from the shapes our code allocates (allocator-visible), by name."""
        return {
            "p2p buffers": self.p2p_bytes,
            "split-backward output gradients": self.split_backward_bytes,
            "tp buffer": self.tp_bytes,
            "MoE dispatch buffers": self.moe_dispatch_bytes,
            "dp buckets": self.dp_bucket_bytes,
            f"largest temporary ({self.largest_temporary})": self.largest_temporary_bytes,
        }

    def allowances(self, after_backward: bool = False) -> dict[str, int]:
        """The uncertain part, by name; after backward only what stays all along (no activations,
        so neither fragmentation of them nor document masks)."""
        nccl = f"NCCL buffers ({', '.join(self.communicators) or 'no communicator'})"
        fixed = {"runtime allowance": self.runtime_bytes, nccl: self.communicator_bytes}
        if after_backward:
            return fixed
        return {
            "fragmentation allowance": self.fragmentation_bytes,
            **fixed,
            "document mask (--reset-attention-mask)": self.mask_bytes,
            self.moe_imbalance: self.moe_imbalance_bytes,
            "cp K/V blocks (ring_attention.py)": self.cp_bytes,
            "cp attention workspaces (per-step outputs)": self.cp_workspace_bytes,
            "NCCL p2p buffers (cp ring, 2 neighbours)": self.cp_p2p_bytes,
            "cp unmeasured (library workspaces, ring buffers)": self.cp_unmeasured_bytes,
        }

    @property
    def fixed_bytes(self) -> int:
        """What every phase holds: the runtime allowance and NCCL's buffers."""
        return sum(self.allowances(after_backward=True).values())

    def components(self) -> dict[str, int]:
        """Named parts, as the start-up check's warning lists them."""
        return {**self.derived(), **self.allowances()}

    @property
    def total(self) -> int:
        return sum(self.components().values())


def logits_temporary(dims: Dims) -> int:
    """Output-layer logits [s, b, V/t] (V padded) in the weight dtype, plus the cross entropy's fp32
    copy when it must cast them (the softmax itself is saved; padding columns are part of it)."""
    extra = FP32 if dims.p != FP32 else 0
    return dims.s * dims.b * dims.vocab * (dims.p + extra)


def fused_logits_temporary(dims: Dims, path: str) -> int:
    """The fused LM head + cross-entropy (tensor_parallel/fused_cross_entropy.py): one chunk's logits
    [chunk, V/t] in the weight dtype (the torch reductions add an fp32 working copy, the Triton
    kernels none: `path`), and the input gradient [s, b, h] the forward fills chunk by chunk (its
    weight gradient is saved for backward: counted with the activations)."""
    tokens = dims.s * dims.b
    per_logit = dims.p + (FP32 if path == "torch" else 0)
    return chunk_tokens(tokens, dims.h, dims.vocab) * dims.vocab * per_logit + tokens * dims.h * dims.p


def split_backward_bytes(dims: Dims, config, layers: int) -> int:
    """What one chunk's split backward queues until its weight step: each linear layer's output
    gradient (tensor_parallel/weight_grads.py; the output layer computes its weight
    gradient at once), per layer QKV [s, b, (heads + 2 groups) d], projection and fc2 [s, b, h]
    (row-parallel outputs, before the sequence reduce-scatter), fc1 [s, b, ffn] (2 ffn with
    SwiGLU), local sizes, in the activation dtype."""
    width = (dims.heads + 2 * dims.groups) * dims.d + 2 * dims.h + dims.ffn * (2 if config.swiglu else 1)
    return layers * dims.s * dims.b * width * dims.p


def pending_weight_step_bytes(dims: Dims, config, layers: int) -> int:
    """What one chunk's deferred WEIGHT step holds after its backward under a zero-bubble schedule:
    the output gradients `split_backward_bytes` counts, and each linear layer's input, which the
    backward would otherwise have freed (QKV and fc1: the residual stream's rows, a sequence shard
    under sequence parallelism; projection [s, b, heads d] and fc2 [s, b, ffn], local sizes).
    An analytic count (MoE layers' experts taken as a dense MLP of the same width), not traced."""
    inputs = layers * dims.b * (2 * dims.s_res * dims.h + dims.s * (dims.heads * dims.d + dims.ffn)) * dims.p
    return split_backward_bytes(dims, config, layers) + inputs


def cp_attention_bytes(dims: Dims, cp: int, comm_type: str) -> int:
    """Blocks alive at the peak of the context-parallel attention's backward (ring_attention.py),
    one block being [k; v] of this rank, 2 s b g d elements. Both variants keep dq in fp32.
    p2p: the held, received and still-referenced sent K/V blocks (3, input dtype) and five fp32
    dK/dV blocks (this rank's own, the one computed, the one in flight with its receive buffer
    and the next receive buffer, posted before the previous transfer is dropped).
    all_gather: the local stack and the cp gathered blocks (input dtype), and the cp stacked
    fp32 dK/dV blocks that are reduce-scattered home."""
    if cp == 1:
        return 0
    block = 2 * dims.s * dims.b * dims.groups * dims.d
    dq = dims.s * dims.b * dims.heads * dims.d * FP32
    if comm_type == "p2p":
        return 3 * block * dims.p + 5 * block * FP32 + dq
    return (1 + cp) * block * dims.p + cp * block * FP32 + dq


def cp_workspace_bytes(dims: Dims, cp: int) -> int:
    """The attention kernels' per-step outputs kept across one attention call's ring: cp blocks of
    [s/cp, b, heads, d] in fp32 (TransformerEngine's p2p attention keeps every step's output, upcast,
    until its last correction; ours merges each into fp32 accumulators), the full sequence's worth."""
    return 0 if cp == 1 else cp * dims.s * dims.b * dims.heads * dims.d * FP32


def expert_rows(dims: Dims, config) -> int:
    """Rows an MoE layer's local experts run on one rank at the balanced load: routes per expert from
    each of the ep x etp ranks whose tokens reach them (alltoall sends, allgather gathers them); with grouped
    experts under allgather, the fixed bound the dispatcher uses to avoid a host sync."""
    ep, etp = config.expert_model_parallel_size, config.expert_tensor_parallel_size
    local = config.num_moe_experts // ep
    if config.moe_grouped_gemm and config.moe_token_dispatcher_type == "allgather":
        return allgather_row_bound(config, dims.s_res * dims.b, ep * etp, local)
    return routes_per_expert(config, dims.s_res * dims.b) * local * ep * etp


def moe_dispatch_bytes(dims: Dims, config) -> int:
    """Two [rows, h] tensors of the dispatcher alive at once (module docstring): alltoall's rows are the
    larger of those sent and those received, allgather's the ep x etp group's tokens."""
    ep, etp = config.expert_model_parallel_size, config.expert_tensor_parallel_size
    if config.moe_token_dispatcher_type == "allgather":
        rows = dims.s_res * dims.b * ep * etp
    else:
        sent = routes_per_expert(config, dims.s_res * dims.b) * config.num_moe_experts
        rows = max(sent, expert_rows(dims, config))
    return 2 * rows * dims.h * dims.p


def largest_temporary(
    dims: Dims,
    config,
    largest_param: int,
    has_last: bool,
    tied_in_one_stage: bool,
    recompute_working: int,
    moe: bool,
    cross_entropy: str = "unfused",
) -> tuple[int, str]:
    """`largest_param`: elements of the rank's largest weight-sized gradient tensor (`weight_gradient_shapes`);
    `moe`: whether the rank has MoE layers;
    `cross_entropy`: KernelChoice.cross_entropy ("unfused", or the fused pass's reductions)."""
    activation_gradients = 3 if config.swiglu else 2
    candidates = {
        "weight gradient": largest_param * dims.p * (2 if tied_in_one_stage else 1),
        "mlp activation gradients": dims.s * dims.b * dims.ffn * dims.p * activation_gradients,
        "recomputation": recompute_working,
    }
    if moe:
        width = config.moe_ffn_hidden_size // config.expert_tensor_parallel_size
        candidates["expert activation gradients"] = expert_rows(dims, config) * width * dims.p * activation_gradients
    if has_last and cross_entropy == "unfused":
        candidates["logits"] = logits_temporary(dims)
    elif has_last:
        candidates["fused cross entropy chunk"] = fused_logits_temporary(dims, cross_entropy)
    name = max(candidates, key=candidates.get)
    return candidates[name], name


def after_backward_temporary(dims: Dims, layout, optimizer_step: int, has_embedding_copy: bool) -> int:
    """The larger of the optimizer step's temporaries and the tied-embedding gradient
    all-reduce's flattened copy (finalize_model_grads concatenates the gradients)."""
    tied_copy = dims.vocab * dims.h * layout.parallel.ddp.grad_dtype.itemsize if has_embedding_copy else 0
    return max(optimizer_step, tied_copy)


@dataclass(frozen=True)
class Allowances:
    """Fragmentation fraction, runtime bytes and NCCL bytes per communicator; defaults depend on
    the device type."""

    fragmentation_fraction: float
    runtime_bytes: int
    communicator_bytes: int = 0
    cp_unmeasured_bytes: int = 0  # context parallelism's (cp > 1): its workspaces and p2p buffers come with it

    @classmethod
    def default(cls, device_type: str) -> Allowances:
        if device_type == "cuda":
            return cls(FRAGMENTATION_FRACTION, CUDA_RUNTIME_BYTES, NCCL_COMMUNICATOR_BYTES, CP_UNMEASURED_BYTES)
        return cls(0.0, 0)


def estimate_transients(
    dims: Dims,
    layout,
    allowances: Allowances,
    *,
    p2p_extra: int,
    split_bytes: int,
    cp_bytes: int,
    largest: tuple[int, str],
    activations: int,
    communicators: tuple[str, ...],
    microbatches_in_flight: int,
    moe_dispatch: int = 0,
    moe_imbalance: tuple[int, str] = (0, ""),
) -> Transients:
    tp_bytes = dims.s * dims.b * dims.h * dims.p if layout.parallel.tp > 1 else 0
    mask_bytes = dims.b * dims.s * dims.s * microbatches_in_flight if layout.document_mask else 0
    dynamic = activations + p2p_extra + split_bytes + tp_bytes + cp_bytes + moe_dispatch + largest[0] + mask_bytes
    cp = layout.parallel.cp > 1 and allowances.cp_unmeasured_bytes > 0
    return Transients(
        p2p_bytes=p2p_extra,
        split_backward_bytes=split_bytes,
        tp_bytes=tp_bytes,
        cp_bytes=cp_bytes,
        dp_bucket_bytes=0,
        largest_temporary_bytes=largest[0],
        largest_temporary=largest[1],
        fragmentation_bytes=int(allowances.fragmentation_fraction * dynamic),
        runtime_bytes=allowances.runtime_bytes,
        communicators=communicators,
        communicator_bytes=allowances.communicator_bytes * len(communicators),
        mask_bytes=mask_bytes,
        moe_dispatch_bytes=moe_dispatch,
        moe_imbalance_bytes=moe_imbalance[0],
        moe_imbalance=moe_imbalance[1],
        cp_workspace_bytes=cp_workspace_bytes(dims, layout.parallel.cp) if cp else 0,
        cp_p2p_bytes=2 * allowances.communicator_bytes if cp else 0,
        cp_unmeasured_bytes=allowances.cp_unmeasured_bytes if cp else 0,
    )
