"""Part moe: grouped experts vs the expert loop, the permutation's bandwidth, host syncs, and whole MoE models.

Section `moe`, per shape (e8-top2 at Mixtral's 4096/14336, e64-top6 at 2048/1408, e128-top8 at Qwen3-30B-A3B's
2048/768; 16k tokens of top-k routes) and routing (balanced: every expert the mean rows; skewed: half the experts
1.5x the mean, the other half 0.5x): bf16 forward + backward (input and weight gradients) of the experts alone,
grouped (`GroupedExperts`, torch's grouped GEMM) and loop (`SequentialExperts`) on the same weights and rows; the
speedup loop / grouped; the grouped forward's TFLOP/s (6 rows h f per forward with SwiGLU); the parts apart, to
show what limits a shape: the experts' two linears alone (no activation, no routing weights), forward + backward,
as grouped GEMMs and as one GEMM per expert on the same weights (`grouped_gemm_ms`, `loop_gemm_ms`), the permute
(index bookkeeping + row gather, `permute_ms`) and the unpermute (`unpermute_ms`); the permutation's effective GB/s
(permute + unpermute of the tokens: tokens and rows each read once and written once); host syncs
per MoE layer (forward + backward with the allgather dispatcher and grouped experts: the reads counted by
token_dispatcher.HOST_SYNCS; the alltoall dispatcher's count and CUDA's own sync-debug warnings in the notes).

Section `moe_models`: a Mixtral-like and a Qwen3-MoE-like Llama with fewer layers, grouped experts, trained on one
GPU: tokens/s, TFLOP/s (megatron/core/transformer/flops.py), step time, and the planner's projected step time
(megatron/planning/moe_cost.py for the MoE layers, on the device's preset).

The part keeps to MOE_BUDGET_S; --dry-run runs the same code on CPU at tiny sizes (times "n/a (dry run)").
"""

from __future__ import annotations

import time

import torch

from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.flops import flops_per_iteration
from megatron.core.transformer.moe import token_dispatcher
from megatron.core.transformer.moe.experts import GroupedExperts, SequentialExperts
from megatron.core.transformer.moe.grouped_gemm import grouped_linear, looped_linear, offsets_of
from megatron.core.transformer.moe.moe_layer import MoELayer
from tools.gpu_check_lib.report import NA
from tools.gpu_check_lib.runs import SyncCounter, error_line, free_device_memory, run_config, train
from tools.gpu_check_lib.step_check import model_flags

MOE_BUDGET_S = 180.0
SHAPES = {  # name: (experts, top-k, hidden, expert ffn)
    "e8-top2": (8, 2, 4096, 14336),
    "e64-top6": (64, 6, 2048, 1408),
    "e128-top8": (128, 8, 2048, 768),
}
TOKENS, DRY_TOKENS, DRY_HIDDEN, DRY_FFN = 16384, 64, 32, 16
SKEW = 1.5
MODELS = {  # name: (layers, hidden, heads, query groups, experts, top-k, expert ffn, seq, micro batches)
    "mixtral-like (2 layers)": (2, 4096, 32, 8, 8, 2, 14336, 4096, 4),
    "qwen3-moe-like (4 layers)": (4, 2048, 16, 4, 128, 8, 768, 4096, 4),
}
DRY_MODELS = {name: (2, 64, 4, 2, m[4], m[5], 32, 32, 2) for name, m in MODELS.items()}


def rows_per_expert(tokens: int, experts: int, topk: int, routing: str) -> list[int]:
    """Rows of each expert for `tokens` tokens of `topk` routes: the mean each (balanced), or half the experts
    SKEW x the mean and the rest what is left (skewed); they sum to tokens x topk."""
    mean = tokens * topk // experts
    if routing == "balanced":
        counts = [mean] * experts
    else:
        high = [round(mean * SKEW)] * (experts // 2)
        low = [mean * 2 - h for h in high] + [mean] * (experts % 2)
        counts = [c for pair in zip(high, low) for c in pair] + low[len(high) :]
    counts[-1] += tokens * topk - sum(counts)
    return counts


def routing_map(tokens: int, counts: list[int], device) -> torch.Tensor:
    """A [tokens, experts] map with `counts[e]` tokens on expert e and the same number of routes on every token:
    the route list sorted by expert, token t taking routes t, t + tokens, ... (distinct experts while no expert
    has more than `tokens`)."""
    experts = torch.repeat_interleave(torch.arange(len(counts), device=device), torch.tensor(counts, device=device))
    chosen = experts.view(-1, tokens).T
    return torch.zeros(tokens, len(counts), dtype=torch.bool, device=device).scatter(1, chosen, True)


def _config(experts: int, topk: int, hidden: int, ffn: int, grouped: bool, dispatcher: str = "allgather"):
    return TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=max(1, hidden // 128),
        ffn_hidden_size=ffn,
        vocab_size=256,
        seq_length=TOKENS,
        swiglu=True,
        add_bias_linear=False,
        params_dtype=torch.bfloat16,
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=ffn,
        moe_grouped_gemm=grouped,
        moe_token_dispatcher_type=dispatcher,
    )


def _time_ms(ctx, fn, reps: int = 5) -> float:
    """Median ms of `fn` after one warm-up call (CUDA events); NA on a dry run (after running it once)."""
    fn()
    if ctx.dry_run:
        return NA
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _experts_ms(ctx, experts, rows, counts, probs) -> tuple:
    """(forward + backward ms, forward ms) of `experts` on `rows`, weight and input gradients."""
    params = [p for p in experts.parameters()]
    grad = torch.randn(rows.shape, dtype=rows.dtype, device=rows.device)

    def forward():
        return experts(rows, counts, probs)

    def forward_backward():
        torch.autograd.grad(forward(), [rows, *params], grad)

    return _time_ms(ctx, forward_backward), _time_ms(ctx, forward)


def _gemms_ms(ctx, experts, rows, counts) -> tuple:
    """(grouped, loop) ms of the experts' two linears alone, forward + backward (input and weight gradients), on
    the grouped weights: torch's grouped GEMM vs one F.linear per expert (looped_linear)."""
    fc1, fc2 = experts.linear_fc1.weight, experts.linear_fc2.weight
    offsets = offsets_of(counts, rows.device)
    mid = torch.randn(rows.shape[0], fc2.shape[-1], dtype=rows.dtype, device=rows.device, requires_grad=True)
    grads = [torch.randn(rows.shape[0], w.shape[1], dtype=rows.dtype, device=rows.device) for w in (fc1, fc2)]

    def grouped():
        outs = [grouped_linear(x, w, offsets, counts=counts) for x, w in ((rows, fc1), (mid, fc2))]
        torch.autograd.grad(outs, [rows, mid, fc1, fc2], grads)

    def loop():
        outs = [looped_linear(x, w, counts) for x, w in ((rows, fc1), (mid, fc2))]
        torch.autograd.grad(outs, [rows, mid, fc1, fc2], grads)

    return _time_ms(ctx, grouped), _time_ms(ctx, loop)


def _permutation(ctx, tokens, mapping, probs, topk) -> dict:
    """permute_ms, unpermute_ms (forward) and the effective GB/s of the two."""
    routes = int(mapping.sum())
    permute_ms = _time_ms(ctx, lambda: token_dispatcher.permute(tokens, mapping, probs, routes, topk))
    rows, _, permutation = token_dispatcher.permute(tokens, mapping, probs, routes, topk)
    unpermute_ms = _time_ms(ctx, lambda: token_dispatcher.unpermute(rows, permutation))
    if ctx.dry_run:
        return dict(permute_ms=NA, unpermute_ms=NA, permute_gbps=NA)
    moved = 2 * (tokens.shape[0] + routes) * tokens.shape[1] * tokens.element_size()
    return dict(
        permute_ms=permute_ms, unpermute_ms=unpermute_ms, permute_gbps=moved / (permute_ms + unpermute_ms) / 1e6
    )


def _host_syncs(ctx, experts: int, topk: int, hidden: int, ffn: int, dispatcher: str, tokens: int) -> tuple:
    """(HOST_SYNCS reads, CUDA sync-debug warnings, their sites) of one MoE layer's forward + backward."""
    layer = MoELayer(_config(experts, topk, hidden, ffn, True, dispatcher), tp_group=None, device=ctx.device)
    _fill(layer)
    hidden_states = torch.randn(tokens, 1, hidden, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
    layer(hidden_states).sum().backward()  # warm-up
    ctx.sync()
    token_dispatcher.HOST_SYNCS.reads = 0
    with SyncCounter(ctx.cuda) as cuda_syncs:
        layer(hidden_states).sum().backward()
        ctx.sync()
    return token_dispatcher.HOST_SYNCS.reads, cuda_syncs.count if ctx.cuda else NA, cuda_syncs.sites


@torch.no_grad()
def _fill(module) -> None:
    """Random weights, fast at real sizes (the layout-independent initialisation is not what is timed)."""
    for param in module.parameters():
        param.normal_(0.0, 0.02)


def _expert_pair(ctx, experts: int, topk: int, hidden: int, ffn: int) -> dict:
    """Grouped and loop experts holding the same weights (the loop's copied from the grouped ones)."""
    grouped = GroupedExperts(_config(experts, topk, hidden, ffn, True), range(experts), device=ctx.device)
    loop = SequentialExperts(_config(experts, topk, hidden, ffn, False), range(experts), device=ctx.device)
    _fill(grouped)
    with torch.no_grad():
        for e, expert in enumerate(loop.local_experts.values()):
            expert.linear_fc1.weight.copy_(grouped.linear_fc1.weight[e])
            expert.linear_fc2.weight.copy_(grouped.linear_fc2.weight[e])
    return {"grouped": grouped, "loop": loop}


def check_moe(report, ctx) -> None:
    section = report.section(
        "moe",
        "MoE experts (bf16, forward + backward): grouped GEMM vs the loop, permutation, host syncs",
        ["shape", "routing", "grouped_ms", "loop_ms", "speedup", "grouped_fwd_tflops", "permute_gbps",
         "host_syncs_per_layer", "grouped_gemm_ms", "loop_gemm_ms", "permute_ms", "unpermute_ms"],
    )  # fmt: skip
    tokens = DRY_TOKENS if ctx.dry_run else TOKENS
    sync_notes, agreement = [], []
    for shape, (experts, topk, hidden, ffn) in SHAPES.items():
        hidden, ffn = (DRY_HIDDEN, DRY_FFN) if ctx.dry_run else (hidden, ffn)
        syncs = _host_syncs(ctx, experts, topk, hidden, ffn, "allgather", tokens)
        alltoall = _host_syncs(ctx, experts, topk, hidden, ffn, "alltoall", tokens)
        sync_notes.append(
            f"{shape}: alltoall {alltoall[0]} read(s) per layer; CUDA sync-debug warnings per layer: allgather "
            f"{syncs[1]}, alltoall {alltoall[1]} ({', '.join(sorted(set(syncs[2]) | set(alltoall[2]))) or '-'})"
        )
        try:
            pair = _expert_pair(ctx, experts, topk, hidden, ffn)
        except Exception as error:  # out of memory: the shape's rows say so
            pair = error_line(error)
        for routing in ("balanced", "skewed"):
            skipped = ctx.skip(20)
            if skipped or time.perf_counter() - ctx.started > MOE_BUDGET_S:
                section.add(shape=shape, routing=routing, grouped_ms=skipped or f"skipped: {MOE_BUDGET_S:.0f} s")
                continue
            row = dict(shape=shape, routing=routing, host_syncs_per_layer=syncs[0])
            try:
                if isinstance(pair, str):
                    raise RuntimeError(pair)
                figures, error = _shape_row(ctx, pair, topk, hidden, tokens, routing)
                row.update(figures)
                agreement.append(f"{shape} {routing} {error:.1e}")
            except Exception as error:  # out of memory, an unsupported shape: the row says so
                row["grouped_ms"] = error_line(error)
            section.add(**row)
            free_device_memory(ctx)
        del pair
        free_device_memory(ctx)
    section.notes += [
        f"{tokens} tokens x top-k routes per shape; skewed: half the experts {SKEW}x the mean rows, half 0.5x; "
        "ms: median of 5 after a warm-up (CUDA events); grouped_fwd_tflops: 6 x rows x hidden x ffn / forward time",
        "permute_gbps: (tokens + routes) x hidden x 2 bytes, read and written, / (permute_ms + unpermute_ms); "
        "permute_ms: the dispatch's permute (index bookkeeping from the routing map + the row gather), unpermute_ms: "
        "the combine's gather-sum, forward each",
        "grouped_gemm_ms / loop_gemm_ms: the experts' two linears alone (no activation, no routing weights), "
        "forward + backward, torch's grouped GEMM vs one F.linear per expert on the same weights",
        "grouped vs loop output, max abs difference / the loop's max (bf16): " + ", ".join(agreement),
        "host_syncs_per_layer: routing reads to the host (token_dispatcher.HOST_SYNCS) in one MoE layer's forward "
        "+ backward, allgather dispatcher, grouped experts; " + "; ".join(sync_notes),
    ]


_TIMED = ("grouped_ms", "loop_ms", "speedup", "grouped_fwd_tflops", "grouped_gemm_ms", "loop_gemm_ms")


def _shape_row(ctx, kinds: dict, topk: int, hidden: int, tokens: int, routing: str) -> tuple[dict, float]:
    """The row's figures, and the grouped output's difference from the loop's (relative to its largest value)."""
    experts = len(kinds["grouped"].local_ids)
    ffn = kinds["grouped"].linear_fc2.weight.shape[-1]
    counts = rows_per_expert(tokens, experts, topk, routing)
    rows_n = sum(counts)
    rows = torch.randn(rows_n, hidden, device=ctx.device, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(rows_n, device=ctx.device, dtype=torch.bfloat16)
    with torch.no_grad():
        grouped_out, loop_out = (kinds[k](rows, counts, probs).float() for k in ("grouped", "loop"))
        error = ((grouped_out - loop_out).abs().max() / loop_out.abs().max()).item()
        del grouped_out, loop_out
    grouped_ms, grouped_fwd = _experts_ms(ctx, kinds["grouped"], rows, counts, probs)
    loop_ms, _ = _experts_ms(ctx, kinds["loop"], rows, counts, probs)
    gemms = _gemms_ms(ctx, kinds["grouped"], rows, counts)
    del rows, probs
    free_device_memory(ctx)
    token_rows = torch.randn(tokens, hidden, device=ctx.device, dtype=torch.bfloat16)
    mapping = routing_map(tokens, counts, ctx.device)
    figures = _permutation(ctx, token_rows, mapping, torch.rand(mapping.shape, device=ctx.device), topk)
    if ctx.dry_run:
        return figures | dict.fromkeys(_TIMED, NA), error
    figures |= dict(grouped_ms=grouped_ms, loop_ms=loop_ms, speedup=loop_ms / grouped_ms)
    figures |= dict(grouped_gemm_ms=gemms[0], loop_gemm_ms=gemms[1])
    return figures | dict(grouped_fwd_tflops=6 * rows_n * hidden * ffn / grouped_fwd / 1e9), error


def _model_flags(ctx, spec) -> list[str]:
    layers, hidden, heads, groups, experts, topk, ffn, seq, micro = spec
    argv = model_flags(ctx.dry_run, micro_batch=1, microbatches=micro, iters=8)
    replace = {"--num-layers": layers, "--hidden-size": hidden, "--ffn-hidden-size": ffn * topk}
    replace |= {"--num-attention-heads": heads, "--num-query-groups": groups}
    replace |= {"--seq-length": seq, "--max-position-embeddings": seq}
    for flag, value in replace.items():
        argv[argv.index(flag) + 1] = str(value)
    argv += ["--num-experts", str(experts), "--moe-router-topk", str(topk), "--moe-ffn-hidden-size", str(ffn)]
    return argv + ["--moe-grouped-gemm", "--moe-aux-loss-coeff", "1e-2"]


def _projected_step_s(ctx, run) -> float:
    """The planner's step time of `run` on the device's preset (the default preset off a CUDA device)."""
    import torch

    from megatron.planning.step_time import DEFAULT_HARDWARE, step_time
    from megatron.training.memory_check import layout_from_run
    from tools.gpu_check_lib.env import device_preset

    hardware = DEFAULT_HARDWARE
    if ctx.cuda:
        memory = torch.cuda.get_device_properties(ctx.device).total_memory
        hardware = device_preset(torch.cuda.get_device_name(ctx.device), memory)[1] or hardware
    return step_time(run.model, layout_from_run(run, "cuda"), hardware).total_s


def check_moe_models(report, ctx) -> None:
    section = report.section(
        "moe_models",
        "Whole MoE models on one GPU (bf16, grouped experts): measured and projected",
        ["name", "tokens_per_s", "tflops", "step_s", "projected_step_s"],
    )
    warmup, iters = (1, 1) if ctx.dry_run else (3, 5)
    for name, spec in (DRY_MODELS if ctx.dry_run else MODELS).items():
        skipped = ctx.skip(60)
        if skipped or time.perf_counter() - ctx.started > MOE_BUDGET_S:
            section.add(name=name, tokens_per_s=skipped or f"skipped: {MOE_BUDGET_S:.0f} s")
            continue
        argv = _model_flags(ctx, spec)
        run = run_config(argv)
        measured = train(ctx, argv, iters, warmup)
        step = measured.step_s
        tokens = run.training.global_batch_size * run.model.seq_length
        flops = flops_per_iteration(run.model, run.training.global_batch_size)
        row = dict(name=name, step_s=step, projected_step_s=_projected_step_s(ctx, run))
        if measured.error:
            row["tokens_per_s"] = measured.error
        elif isinstance(step, float):
            row.update(tokens_per_s=tokens / step, tflops=flops / step / 1e12)
        else:
            row.update(tokens_per_s=NA, tflops=NA)
        section.add(**row)
    section.notes += [
        "models: Llama with every layer MoE (SwiGLU experts, grouped GEMM, allgather dispatcher, one GPU); "
        + "; ".join(f"{n}: layers, hidden, heads, groups, experts, top-k, expert ffn, seq, microbatches = {s}"
                    for n, s in (DRY_MODELS if ctx.dry_run else MODELS).items()),
        f"warm-up {warmup} + {iters} timed iterations; TFLOP/s: megatron/core/transformer/flops.py (routed experts)",
        "projected_step_s: the planner's step-time model (megatron/planning/moe_cost.py) on the device's preset",
    ]  # fmt: skip
