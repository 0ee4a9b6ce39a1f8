"""Saved activations and parameter shapes of a rank's model chunks, traced from our own modules.

Nothing here restates what a layer keeps. A chunk's modules (GPTModel with the rank's tp, cp,
sequence parallelism, recomputation and kernels) are built at their per-rank size with fake
tensors (shapes and dtypes, no memory: torch's FakeTensorMode), process groups of the rank's
sizes that move no data (fake_dist.py), and a forward runs as the pipeline executor runs it:
token ids into the first stage, a received [s, b, h] input (held by the executor until the
backward) into the others, the per-token loss through `StepStats.add_loss` on the last. What
autograd saves is recorded with `saved_tensors_hooks`, one count per storage, parameters
excluded -- the rule tools/bench/estimator_accuracy.py measures real runs with. A saved storage
that is a module buffer (the positions of learned position embeddings) is the same for every
microbatch and is reported apart (`shared_bytes`). A forward is enough: saved tensors are
packed during the forward only, and backward allocates transients (transients.py).

MoE layers run their experts on the rows the routing sends them, data that fake tensors do not
have: the dispatchers read it in one place, for which the trace stands in the balanced load
(moe_routing.py; `Setting.routing_load` times it for the imbalance allowance), and build expert
groups of the config's ep and etp sizes.

For a CUDA estimate the trace's fake CPU tensors dispatch as on CUDA: the traced config names
the paths kernels/dispatch.py `kernel_paths` chooses there (`_for_device`; our Triton kernels
run shape-only: outputs allocated and saved, nothing launched), torch's device-dependent ops
through cuda_ops.py.

Speed: layers of one kind (MoE or dense) are identical, so a chunk is never traced whole. It is
cut into pieces: the embedding, its layers in units (`_units`: one layer, or one recomputed
group as TransformerBlock forms them), the head; each kind of piece is traced once, and a
chunk adds up its pieces' own storages, each storage passed from one piece to the next once
when either keeps it, and once what the block hands every layer (rotary angles, attention
mask) if a layer keeps it. That is exact as long as a piece keeps nothing of another piece
but its input and output, and the layers of a chunk differ only in their index and kind
(tests/parallel/test_memory_measured.py would show otherwise). Every trace is cached, so the
planner traces each distinct (configuration, tp, cp, micro batch, device) once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.utils.checkpoint
from torch._subclasses.fake_tensor import FakeTensorMode

from kernels.dispatch import UNFUSED
from megatron.core.models.gpt_model import GPTModel
from megatron.core.parallel_state import ExpertGroups
from megatron.core.pipeline_parallel.executor import StepStats
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.block import layer_groups
from megatron.core.transformer.config import TransformerConfig
from megatron.planning.cuda_ops import CudaOps
from megatron.planning.fake_dist import FakeGroup, fake_collectives
from megatron.planning.moe_routing import stand_in_routing

LAYER_PREFIX = "decoder.layers."


@dataclass(frozen=True)
class Setting:
    """What a trace depends on besides the model config."""

    tp: int
    cp: int
    micro_batch_size: int
    device_type: str
    attention: str  # KernelChoice.attention: the SDPA kernel a CUDA run picks
    routing_load: float = 1.0  # MoE: routes per expert as a multiple of the balanced load (moe_routing.py)


@dataclass(frozen=True)
class Saved:
    """Bytes one microbatch's forward leaves for backward."""

    bytes: int  # storages of this microbatch (the held chunk input included)
    shared_bytes: int  # module buffers: one storage for every microbatch of the chunk
    recompute_bytes: int  # the largest recomputed region, re-materialised in backward


class _NoRandomness:
    """Stands in for the chunk's RNGTracker: dropout draws nothing from fake tensors."""

    @staticmethod
    def fork(tensor_parallel: bool):
        return contextlib.nullcontext()

    def get_state(self):
        return None

    def set_state(self, states) -> None:
        pass


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Recorder:
    """Unique storages saved for backward (parameters excluded, buffers apart), and the largest
    set saved inside a recomputed region (torch.utils.checkpoint, as tensor_parallel.random.recompute
    calls it: run once more, plainly, to see what its recomputation holds besides its inputs)."""

    def __init__(self, model: torch.nn.Module):
        self.params = {_storage(p) for p in model.parameters()}
        self.buffers = {_storage(b) for b in model.buffers()}
        self.saved: dict[int, int] = {}
        self.shared: dict[int, int] = {}
        self.recompute_bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage(t)
        if key not in self.params:
            (self.shared if key in self.buffers else self.saved)[key] = t.untyped_storage().nbytes()
        return t

    @contextlib.contextmanager
    def recording(self):
        checkpoint = torch.utils.checkpoint.checkpoint

        def observed(function, *args, **kwargs):
            skip = self.params | self.buffers | {_storage(a) for a in args if isinstance(a, torch.Tensor)}
            inner: dict[int, int] = {}

            def pack(t):
                if _storage(t) not in skip:
                    inner[_storage(t)] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, _identity):
                function(*args)
            self.recompute_bytes = max(self.recompute_bytes, sum(inner.values()))
            return checkpoint(function, *args, **kwargs)

        torch.utils.checkpoint.checkpoint = observed
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, _identity):
                yield
        finally:
            torch.utils.checkpoint.checkpoint = checkpoint


def _identity(t):
    return t


@contextlib.contextmanager
def _fake_run(device_type: str, attention: str):
    """Fake tensors, fake groups and, for CUDA, the CUDA kernels' saving behaviour."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(fake_collectives())
        if device_type == "cuda":
            stack.enter_context(CudaOps(attention))
        yield


def _build(config: TransformerConfig, tp: int, cp: int, pre: bool, post: bool, layer_ids: list[int]) -> GPTModel:
    ep, etp = config.expert_model_parallel_size, config.expert_tensor_parallel_size
    experts = ExpertGroups(ep=FakeGroup(ep), etp=FakeGroup(etp), tp_ep=FakeGroup(ep * etp), tp_cp=FakeGroup(tp * cp))
    return GPTModel(
        config,
        tp_group=FakeGroup(tp),
        rng_tracker=_NoRandomness(),
        layer_ids=layer_ids,
        pre_process=pre,
        post_process=post,
        cp_group=FakeGroup(cp) if cp > 1 else None,
        expert_groups=experts,
        device="cpu",
    )


def _layer_ids(config: TransformerConfig, pattern: tuple[bool, ...]) -> list[int]:
    """Distinct global layer indices whose kinds (MoE layer or not) follow `pattern`: a traced piece's layers
    differ from a chunk's only in their index."""
    if config.num_moe_experts is None:
        return list(range(len(pattern)))  # any index is a dense layer's
    pattern_of_model = _moe_pattern(config, range(config.num_layers))
    kinds = {moe: iter([i for i, kind in enumerate(pattern_of_model) if kind == moe]) for moe in (False, True)}
    return [next(kinds[moe]) for moe in pattern]


def _moe_pattern(config: TransformerConfig, layer_ids) -> tuple[bool, ...]:
    return tuple(config.is_moe_layer(i) for i in layer_ids)


_FIELDS = tuple(f.name for f in dataclasses.fields(TransformerConfig))


def config_key(config: TransformerConfig) -> tuple:
    """The config's field values: a cache key from which `TransformerConfig(*key)` rebuilds it (a list,
    --moe-layer-freq's, as a tuple)."""
    return tuple(_hashable(getattr(config, name)) for name in _FIELDS)


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class _Piece:
    """One traced piece of a chunk (the embedding, a unit of layers, the head) on one microbatch."""

    own_bytes: int  # saved storages other than its input, its output and the block's shared inputs
    block_inputs_bytes: int  # saved storages among what the block hands every layer (angles, mask)
    input_saved: bool
    output_saved: bool
    output_bytes: int
    shared_bytes: int
    recompute_bytes: int


def _without_recompute(config: TransformerConfig) -> TransformerConfig:
    if config.recompute_granularity is None:
        return config
    return dataclasses.replace(config, recompute_granularity=None, recompute_method=None, recompute_num_layers=None)


@functools.lru_cache(maxsize=8192)
def _trace(key: tuple, setting: Setting, kind: str, pattern: tuple[bool, ...] = ()) -> _Piece:
    """kind: "embedding" (token ids in, hidden states out), "layers" (a middle chunk of layers, MoE
    where `pattern` says so) or "head" (final norm, output layer, the loss accounted as the executor does)."""
    config = TransformerConfig(*key)
    b, s = setting.micro_batch_size, config.seq_length // setting.cp
    rows = s // setting.tp if config.sequence_parallel else s  # of the residual stream: a layer's tokens
    pre, post = kind == "embedding", kind == "head"
    with _fake_run(setting.device_type, setting.attention), stand_in_routing(config, rows * b, setting.routing_load):
        model = _build(config, setting.tp, setting.cp, pre, post, _layer_ids(config, pattern))
        for p in model.parameters():  # as ModelChunkBuffers: linear layers add weight gradients into it
            p.main_grad = torch.empty(p.shape, dtype=torch.float32)
        if pre:
            x = torch.zeros(b, s, dtype=torch.long)
        else:
            x = torch.empty(rows, b, config.hidden_size, dtype=config.params_dtype, requires_grad=True)
        recorder = _Recorder(model)
        block_inputs = set()
        model.decoder.register_forward_pre_hook(
            lambda _, args: block_inputs.update(_storage(a) for a in args[1:] if isinstance(a, torch.Tensor))
        )
        with recorder.recording():
            if post:
                labels, loss_mask = torch.zeros(b, s, dtype=torch.long), torch.ones(b, s)
                out = StepStats.zeros("cpu").add_loss(model(x, labels, loss_mask=loss_mask), loss_mask)
            else:
                out = model(x)
    saved = dict(recorder.saved)
    input_saved = not pre and saved.pop(_storage(x), None) is not None  # token ids stay the embedding's own
    output_saved = saved.pop(_storage(out), None) is not None
    shared_inputs = sum(saved.pop(key) for key in block_inputs & saved.keys())
    return _Piece(
        sum(saved.values()),
        shared_inputs,
        input_saved,
        output_saved,
        out.untyped_storage().nbytes(),
        sum(recorder.shared.values()),
        recorder.recompute_bytes,
    )


def _units(config: TransformerConfig, pattern: tuple[bool, ...]) -> list[tuple[tuple[bool, ...], bool]]:
    """(layer kinds, recomputed?) of a chunk's units: each recomputed group, and each other layer."""
    units = []
    for start, end, recomputed in layer_groups(config, len(pattern)):
        if recomputed:
            units.append((pattern[start:end], True))
        else:
            units += [(pattern[i : i + 1], False) for i in range(start, end)]
    return units


def _unit_config(config: TransformerConfig, pattern: tuple[bool, ...], recomputed: bool) -> TransformerConfig:
    """A config whose block runs the layers of `pattern` as one unit of this kind."""
    if recomputed:
        return dataclasses.replace(config, recompute_method="uniform", recompute_num_layers=len(pattern))
    if config.recompute_granularity == "full":
        return dataclasses.replace(config, recompute_granularity=None, recompute_method=None, recompute_num_layers=None)
    return config


def _residual_bytes(config: TransformerConfig, setting: Setting) -> int:
    """One microbatch's [s, b, h] hidden states between pipeline stages (a sequence shard under SP)."""
    rows = config.seq_length // setting.cp // (setting.tp if config.sequence_parallel else 1)
    return rows * setting.micro_batch_size * config.hidden_size * config.params_dtype.itemsize


def _for_device(config: TransformerConfig, device_type: str) -> TransformerConfig:
    """`config` with the attention, normalization and fused cross-entropy paths a run on `device_type`
    takes (with Triton installed), so that the trace's fake CPU tensors run them."""
    paths = config.kernel_paths(device_type, assume_triton=True)
    attention = config.attention_backend if paths.attention == UNFUSED else paths.attention_kernel.impl
    cross_entropy = config.cross_entropy_impl if paths.cross_entropy is None else paths.cross_entropy.impl
    return dataclasses.replace(
        config,
        attention_backend=attention,
        normalization_impl=paths.norm.impl,
        rope_impl=paths.rope.impl,
        swiglu_impl=paths.swiglu.impl,
        cross_entropy_impl=cross_entropy,
    )


def chunk_saved(config: TransformerConfig, setting: Setting, pre: bool, post: bool, layer_ids) -> Saved:
    """Saved bytes of one microbatch on a chunk of the layers `layer_ids` (module docstring): its pieces'
    own tensors, each storage passed between two pieces once when either keeps it (a received input
    is kept by the executor in any case), and the block's shared inputs once."""
    key = config_key(_for_device(config, setting.device_type))
    return _chunk_saved(key, setting, pre, post, _moe_pattern(config, layer_ids))


@functools.lru_cache(maxsize=65536)
def _chunk_saved(key: tuple, setting: Setting, pre: bool, post: bool, pattern: tuple[bool, ...]) -> Saved:
    config = TransformerConfig(*key)
    plain = config_key(_without_recompute(config))
    units = _units(config, pattern)
    unrouted = dataclasses.replace(setting, routing_load=1.0)  # pieces without MoE layers: one trace for any load
    kinds = {
        kind: _trace(config_key(_unit_config(config, *kind)), setting if any(kind[0]) else unrouted, "layers", kind[0])
        for kind in set(units)
    }
    pieces = ([_trace(plain, unrouted, "embedding")] if pre else []) + [kinds[kind] for kind in units]
    pieces += [_trace(plain, unrouted, "head")] if post else []
    total = 0 if pre else _residual_bytes(config, setting)
    for before, after in zip(pieces, pieces[1:]):
        total += before.output_bytes if before.output_saved or after.input_saved else 0
    total += sum(p.own_bytes for p in pieces) + max(p.block_inputs_bytes for p in pieces)
    return Saved(total, sum(p.shared_bytes for p in pieces), max(p.recompute_bytes for p in pieces))


class Parameter(NamedTuple):
    shape: tuple[int, ...]
    is_expert: bool
    linear_weight: bool  # a linear layer's own weight: its gradient goes into main_grad, never to autograd


@functools.lru_cache(maxsize=8192)
def _parameter_shapes(key: tuple, tp: int, pre: bool, post: bool) -> tuple[tuple, dict, tuple]:
    """(the parameters before the layers, {MoE layer?: one such layer's}, those after), each a
    `Parameter` in named_parameters() order, from a chunk with one layer of each kind."""
    config = TransformerConfig(*key)
    kinds = sorted({config.is_moe_layer(i) for i in range(config.num_layers)})
    with _fake_run("cpu", "flash"):
        model = _build(config, tp, 1, pre, post, _layer_ids(config, tuple(kinds)))
    linears = [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    linear_weights = {id(m.weight) for m in linears if m.weight is not None}  # None: a tied output layer's
    before, layers, after = [], {moe: [] for moe in kinds}, []
    for name, p in model.named_parameters():
        parameter = Parameter(tuple(p.shape), getattr(p, "is_expert", False), id(p) in linear_weights)
        if name.startswith(LAYER_PREFIX):
            layers[config.is_moe_layer(int(name[len(LAYER_PREFIX) :].split(".")[0]))].append(parameter)
        else:
            (after if any(layers.values()) else before).append(parameter)
    return tuple(before), {moe: tuple(shapes) for moe, shapes in layers.items()}, tuple(after)


def chunk_parameter_shapes(config: TransformerConfig, tp: int, pre: bool, post: bool, layer_ids) -> list[Parameter]:
    """This tp rank's parameters of a chunk of the layers `layer_ids`, in named_parameters() order
    (the gradient buffers' bucket layouts depend on it), each with whether it is an expert's and a
    linear layer's own weight."""
    before, layers, after = _parameter_shapes(config_key(_without_recompute(config)), tp, pre, post)
    return [*before, *(p for i in layer_ids for p in layers[config.is_moe_layer(i)]), *after]


def trace_cache_clear() -> None:
    """Forget every trace (benchmarks time a cold start)."""
    for cache in (_trace, _chunk_saved, _parameter_shapes):
        cache.cache_clear()


def traces_run() -> int:
    """Distinct chunk traces run since the last `trace_cache_clear`."""
    return _trace.cache_info().currsize
