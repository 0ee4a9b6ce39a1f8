"""Tensor-parallel collectives, vocab-parallel cross-entropy (unfused, and fused with the output layer
under TP and TP+SP) and the RNG tracker on 2 gloo ranks, each against the same computation done in one
process."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.distributed.model_chunk_buffers import DDPConfig, ModelChunkBuffers
from megatron.core.parallel_config import ParallelConfig
from megatron.core.tensor_parallel import mappings as M
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.fused_cross_entropy import fused_output_cross_entropy
from megatron.core.tensor_parallel.initialization import initialize_parameters
from megatron.core.tensor_parallel.random import RNGTracker, recompute
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.layer import TransformerLayer
from megatron.planning.layout import MemoryLayout
from megatron.planning.transients import Dims, split_backward_bytes
from tests.distributed import run_distributed

WORLD = 2


def _input(rank, shape):
    """Rank `rank`'s input; every rank can rebuild every rank's tensors."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)


def _upstream(rank, shape):
    """The gradient rank `rank` feeds into backward."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(200 + rank), dtype=torch.float64)


def _run(fn, rank, in_shape, out_shape):
    x = _input(rank, in_shape).requires_grad_(True)
    y = fn(x, dist.group.WORLD)
    y.backward(_upstream(rank, out_shape))
    return y.detach(), x.grad


def check_collectives(rank):
    xs = [_input(r, (4, 2, 6)) for r in range(WORLD)]
    cases = {
        # name: (function, output shape, expected forward, expected input gradient)
        "copy": (
            M.copy_to_tensor_parallel_region,
            (4, 2, 6),
            xs[rank],
            sum(_upstream(r, (4, 2, 6)) for r in range(WORLD)),
        ),
        "reduce": (M.reduce_from_tensor_parallel_region, (4, 2, 6), sum(xs), _upstream(rank, (4, 2, 6))),
        "scatter_last": (
            M.scatter_to_tensor_parallel_region,
            (4, 2, 3),
            xs[rank].chunk(WORLD, -1)[rank],
            torch.cat([_upstream(r, (4, 2, 3)) for r in range(WORLD)], -1),
        ),
        "gather_last": (
            M.gather_from_tensor_parallel_region,
            (4, 2, 12),
            torch.cat(xs, -1),
            _upstream(rank, (4, 2, 12)).chunk(WORLD, -1)[rank],
        ),
        "scatter_seq": (
            M.scatter_to_sequence_parallel_region,
            (2, 2, 6),
            xs[rank].chunk(WORLD, 0)[rank],
            torch.cat([_upstream(r, (2, 2, 6)) for r in range(WORLD)], 0),
        ),
        "gather_seq": (
            M.gather_from_sequence_parallel_region,
            (8, 2, 6),
            torch.cat(xs, 0),
            sum(_upstream(r, (8, 2, 6)) for r in range(WORLD)).chunk(WORLD, 0)[rank],
        ),
        "reduce_scatter_seq": (
            M.reduce_scatter_to_sequence_parallel_region,
            (2, 2, 6),
            sum(xs).chunk(WORLD, 0)[rank],
            torch.cat([_upstream(r, (2, 2, 6)) for r in range(WORLD)], 0),
        ),
    }
    for name, (fn, out_shape, expected_y, expected_grad) in cases.items():
        y, grad = _run(fn, rank, (4, 2, 6), out_shape)
        torch.testing.assert_close(y, expected_y, msg=f"{name} forward")
        torch.testing.assert_close(grad, expected_grad, msg=f"{name} backward")


def check_cross_entropy(rank):
    """Megatron's vocab-parallel cross-entropy: the softmax spans the padding columns too."""
    vocab, padded = 10, 12
    g = torch.Generator().manual_seed(7)
    full = torch.randn(5, 3, padded, generator=g, dtype=torch.float64)
    target = torch.randint(0, vocab, (5, 3), generator=g)
    reference_logits = full.clone().requires_grad_(True)
    expected = F.cross_entropy(reference_logits.reshape(-1, padded), target.reshape(-1), reduction="none").view(5, 3)
    expected.sum().backward()
    local = full.chunk(WORLD, -1)[rank].clone().requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, target, dist.group.WORLD, rank * (padded // WORLD))
    loss.sum().backward()
    torch.testing.assert_close(loss, expected.detach().float(), rtol=1e-6, atol=1e-6)
    expected_grad = reference_logits.grad.chunk(WORLD, -1)[rank]
    torch.testing.assert_close(local.grad, expected_grad.to(local.grad.dtype), rtol=1e-6, atol=1e-6)


def check_fused_cross_entropy(rank):
    """The fused output layer + cross-entropy on this rank's vocabulary rows (140 padded rows, 70 each) and
    tokens (a sequence shard under SP; chunks of 4 of 15 tokens) gives the one-process losses and gradients,
    of a masked loss times a scale (the gradients are computed in the forward from the mask)."""
    s, b, h, padded = 5, 3, 8, 140
    g = torch.Generator().manual_seed(11)
    x, weight = torch.randn(s * WORLD, b, h, generator=g), torch.randn(padded, h, generator=g)
    target = torch.randint(0, padded - 10, (s * WORLD, b), generator=g)
    full_x, full_w = x.double().requires_grad_(), weight.double().requires_grad_()
    expected = F.cross_entropy((full_x @ full_w.t()).flatten(0, 1), target.flatten(), reduction="none").view(
        s * WORLD, b
    )
    mask = (torch.rand(s * WORLD, b, generator=g) > 0.3).float()
    (expected * mask).sum().mul(0.3).backward()
    rows = slice(rank * padded // WORLD, (rank + 1) * padded // WORLD)
    for impl in ("triton", "torch"):
        for sp in (False, True):
            tokens = slice(rank * s, (rank + 1) * s) if sp else slice(None)
            local_x = x[tokens].clone().requires_grad_()
            local_w = weight[rows].clone().requires_grad_()
            loss = fused_output_cross_entropy(
                local_x,
                local_w,
                target,
                tp_group=dist.group.WORLD,
                sequence_parallel=sp,
                impl=impl,
                loss_mask=mask,
                chunk=4,
            )
            (loss * mask).sum().mul(0.3).backward()
            torch.testing.assert_close(loss, expected.detach().float(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(local_x.grad, full_x.grad[tokens].float(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(local_w.grad, full_w.grad[rows].float(), rtol=1e-5, atol=1e-6)


def check_rng_tracker(rank):
    tracker = RNGTracker("cpu", seed=5, tp_rank=rank)
    with tracker.fork(tensor_parallel=False):
        outside = F.dropout(torch.ones(64), 0.5)
    with tracker.fork(tensor_parallel=True):
        inside = F.dropout(torch.ones(64), 0.5)
    masks = [None] * WORLD
    dist.all_gather_object(masks, (outside, inside))
    assert torch.equal(masks[0][0], masks[1][0]), "dropout outside tp regions must agree across tp ranks"
    assert not torch.equal(masks[0][1], masks[1][1]), "dropout inside tp regions must differ across tp ranks"
    again = RNGTracker("cpu", seed=5, tp_rank=rank)
    with again.fork(tensor_parallel=True):
        assert torch.equal(F.dropout(torch.ones(64), 0.5), inside), "same seed must give the same mask"

    def dropped(x):
        with tracker.fork(tensor_parallel=True):
            x = F.dropout(x, 0.5) * x
        with tracker.fork(tensor_parallel=False):
            return F.dropout(x, 0.5)

    x = torch.randn(32, requires_grad=True)
    state = tracker.get_state()
    dropped(x).sum().backward()
    direct = x.grad.clone()
    x.grad = None
    tracker.set_state(state)
    recompute(dropped, tracker, x).sum().backward()
    torch.testing.assert_close(x.grad, direct, msg="recomputed dropout must replay the forward masks")


def check_layer_communication_volume(rank):
    """A layer's counted tp traffic equals Megatron's analytic volume: 4 all-reduces of s*b*h
    without SP; with SP 4 all-gathers + 4 reduce-scatters of s*b*h, plus the 2 all-gathers that
    re-gather the column-parallel inputs in backward (only their sequence shards are saved)."""
    s, b, h = 8, 2, 32
    volume = s * b * h * 4
    for sp, expected in (
        (False, {"all_reduce": 4 * volume}),
        (True, {"all_gather": 6 * volume, "reduce_scatter": 4 * volume}),
    ):
        config = TransformerConfig(
            num_layers=1,
            hidden_size=h,
            num_attention_heads=4,
            vocab_size=16,
            seq_length=s,
            tensor_model_parallel_size=WORLD,
            sequence_parallel=sp,
        )
        layer = TransformerLayer(config, tp_group=dist.group.WORLD, rng_tracker=RNGTracker("cpu", 0, tp_rank=rank))
        initialize_parameters(layer, seed=0)
        x = torch.randn(s // WORLD if sp else s, b, h, requires_grad=True)
        with M.COMM_STATS.counting() as stats:
            layer(x).sum().backward()
        assert stats.bytes == expected, (sp, stats.bytes)


LINEAR_WEIGHTS = {
    "self_attention.linear_qkv.weight",
    "self_attention.linear_proj.weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
}


def _accumulated_grads(mode: str, tp_group, dp_group, sp: bool, rank: int) -> tuple[dict, set]:
    """Gradients of a layer after 3 microbatches averaged over dp, and the weights whose linear layer
    added (or queued) their gradient itself. mode "autograd": plain .grad, no buffers, averaged by
    hand; otherwise main_grad of the layer wrapped in its buffers (the last microbatch starting the
    dp reduction from the hooks) with gradient accumulation fusion ("fused"), without ("unfused"),
    or fused with a split backward ("split": weight gradients computed after the backward)."""
    s, b, h = 8, 2, 32
    tp = dist.get_world_size(tp_group)
    config = TransformerConfig(
        num_layers=1,
        hidden_size=h,
        num_attention_heads=4,
        vocab_size=16,
        seq_length=s,
        tensor_model_parallel_size=tp,
        sequence_parallel=sp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gradient_accumulation_fusion=mode != "unfused",
    )
    layer = TransformerLayer(config, tp_group=tp_group, rng_tracker=RNGTracker("cpu", 0, tp_rank=rank % tp))
    initialize_parameters(layer, seed=0)
    through_autograd = set()  # parameters autograd gave a gradient (the others' layers added theirs)

    def record(name):
        def hook(param):
            if param.grad is not None:  # autograd calls the hook of a parameter it gave none, too
                through_autograd.add(name)

        return hook

    chunk = None
    if mode != "autograd":
        for name, param in layer.named_parameters():
            param.register_post_accumulate_grad_hook(record(name))
        chunk = ModelChunkBuffers(layer, DDPConfig(), dp_group)
        chunk.zero_grad_buffer()
    for microbatch in range(3):
        x = torch.randn(s // tp if sp else s, b, h, generator=torch.Generator().manual_seed(10 * microbatch + rank))
        if chunk is None:
            layer(x).square().sum().backward()
            continue
        chunk.set_is_last_microbatch(microbatch == 2)
        if mode == "split":
            with chunk.deferring_weight_grads():
                chunk(x).square().sum().backward()
            assert chunk.weight_grads.params[0] == {p for n, p in layer.named_parameters() if n in LINEAR_WEIGHTS}
            chunk.compute_weight_grads()
        else:
            chunk(x).square().sum().backward()
    if chunk is None:
        grads = {n: p.grad for n, p in layer.named_parameters()}
        for grad in grads.values():
            dist.all_reduce(grad.div_(dist.get_world_size(dp_group)), group=dp_group)
        return grads, set()
    chunk.finish_grad_sync()
    by_layers = {n for n, _ in layer.named_parameters()} - through_autograd
    return {n: p.main_grad.clone() for n, p in layer.named_parameters()}, by_layers


def check_gradient_accumulation_fusion(rank):
    """Linear layers that add their weight gradients into main_grad themselves (fused or not), and a
    split backward that computes them after the rest, accumulate the gradients plain autograd does,
    under TP (with and without SP) and DP (bucket reductions started by the hooks of the last
    microbatch, or by compute_weight_grads after a split backward)."""
    alone = [dist.new_group([r]) for r in range(WORLD)][rank]
    layouts = {
        "tp2": (dist.group.WORLD, alone, False),
        "tp2+sp": (dist.group.WORLD, alone, True),
        "dp2": (alone, dist.group.WORLD, False),
    }
    for layout, (tp_group, dp_group, sp) in layouts.items():
        reference, _ = _accumulated_grads("autograd", tp_group, dp_group, sp, rank)
        for mode in ("fused", "unfused", "split"):
            grads, by_layers = _accumulated_grads(mode, tp_group, dp_group, sp, rank)
            assert by_layers == LINEAR_WEIGHTS, (layout, mode, by_layers)
            for name, grad in reference.items():
                torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-5, msg=f"{layout} {mode} {name}")


def check_split_backward_queue_bytes(rank):
    """What a split backward queues (the linear layers' output gradients) is what the memory
    estimate counts for it, GPT and Llama (GQA, SwiGLU), under TP2 with and without SP."""
    alone = [dist.new_group([r]) for r in range(WORLD)][rank]
    for sp in (False, True):
        for llama in (False, True):
            variant = dict(num_query_groups=2, swiglu=True, add_bias_linear=False) if llama else {}
            config = TransformerConfig(
                num_layers=1,
                hidden_size=32,
                num_attention_heads=4,
                vocab_size=16,
                seq_length=8,
                tensor_model_parallel_size=WORLD,
                sequence_parallel=sp,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                **variant,
            )
            layer = TransformerLayer(config, tp_group=dist.group.WORLD, rng_tracker=RNGTracker("cpu", 0, tp_rank=rank))
            initialize_parameters(layer, seed=0)
            chunk = ModelChunkBuffers(layer, DDPConfig(), alone)
            chunk.zero_grad_buffer()
            with chunk.deferring_weight_grads():
                chunk(torch.randn(8 // WORLD if sp else 8, 3, 32)).square().sum().backward()
            queued = {
                w.grad_out.untyped_storage().data_ptr(): w.grad_out.untyped_storage().nbytes()
                for w in chunk.weight_grads.pending[0]
            }
            dims = Dims.of(config, MemoryLayout(ParallelConfig(tp=WORLD), micro_batch_size=3))
            assert sum(queued.values()) == split_backward_bytes(dims, config, layers=1), (sp, llama, queued)
            chunk.compute_weight_grads()


def all_checks(rank):
    check_collectives(rank)
    check_layer_communication_volume(rank)
    check_gradient_accumulation_fusion(rank)
    check_split_backward_queue_bytes(rank)
    check_cross_entropy(rank)
    check_fused_cross_entropy(rank)
    check_rng_tracker(rank)
    return True


def test_tensor_parallel_ops_match_one_process():
    assert run_distributed(WORLD, all_checks) == [True] * WORLD
