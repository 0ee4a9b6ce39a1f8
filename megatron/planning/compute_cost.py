"""Seconds of computation of one transformer layer, one microbatch, on one rank.

Three kinds of work, each timed from first principles:

* GEMMs: FLOPs (2 per multiply-accumulate) at `gemm_peak_fraction` of the device peak plus
  the bytes of its three matrices at HBM bandwidth, a roofline whose two terms add (tiles load
  while others multiply, but not perfectly): the efficiency follows the GEMM's shape through its
  arithmetic intensity, so small per-rank GEMMs (hidden / tp under high tp, the head dimension
  of unfused attention) run further below peak, and more so on a device whose FLOPs outgrow its
  bandwidth (H100: 295 FLOP per byte; A100: 153). A GEMM's backward is two GEMMs with the same
  three dimensions (input and weight gradients), so the same time each.
* attention: the flash path (ours or torch's: no dropout) at `flash_fraction` of peak on the
  FLOPs it really does (half of the s x s scores under the causal mask; the backward
  recomputes the scores: 2.5 x the forward); the unfused path (attention dropout) as two
  batched GEMMs per head (s x s x d, the shape curve above) plus the softmax and dropout
  passes over the [heads, s, s] scores at HBM bandwidth.
* elementwise (norms, bias + activation, dropout + residual, rotary): bytes read and written
  at `hbm_efficiency` of the HBM bandwidth.
* FP8 (`config.fp8`, the trainer's `--fp8-format`): the linear layers' GEMMs (QKV, projection, MLP,
  experts; not the logits, not attention) take FP8 operands at the device's FP8 peak x
  `fp8_gemm_peak_fraction` (the same roofline, its own constant), plus the fused casts' bytes per
  operand (docs/fp8.md's pass counts) at HBM bandwidth; the three GEMMs of a linear (forward, input
  gradient, weight gradient) each timed at its own output.
* `layer_overhead_s` per layer and forward (twice per backward): the host's time to launch a
  layer's kernels, which the GPU waits for when they are short (small models, small micro batches).

The constants live in `Calibration`; docs/planner.md says what each is fitted to.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron.planning.hardware import Hardware
from megatron.planning.kernels import dtype_bytes

UNFUSED = ("math", "efficient")


@dataclass(frozen=True)
class Calibration:
    """The step-time model's constants. Fitted (tools/bench/planner_calibration.py --fit --all) on
    the 50 dense published runs of tools/bench/published_runs.py ALL_RUNS, each of their 5 sources
    weighted equally: the GEMM curve, flash efficiency and the host overheads; then `expert_rows_half`
    on its MoE runs alone and `fp8_gemm_peak_fraction` on the 36 FP8 runs of published_fp8_runs.py alone,
    the others held. Taken from public
    measurements, not fitted: the share of link and HBM bandwidth reached.

    The fit on the calibration set alone (19 rows, 2 sources) gave flash 0.25 and 0.4 ms per layer;
    on all 5 sources the per-layer launch overhead goes to 0: the mbs-1 rows of the other sources
    (NVIDIA's DGX Cloud recipes, Llama 3) run far more layer passes than the calibration set's.
    Flash went from 0.20 to 0.25 when Llama 3's rows got their per-microbatch parameter gathers and
    exposed context-parallel all-gather (tools/bench/published_runs.py `_llama3`)."""

    gemm_peak_fraction: float = 0.80
    # FP8 GEMMs: the share of the FP8 peak (Hardware.fp8_tflops) the same roofline reaches; fitted on the published
    # FP8 rows alone (tools/bench/published_runs.py FP8_RUNS), the other constants held: it moves no BF16 row
    fp8_gemm_peak_fraction: float = 0.90
    flash_fraction: float = 0.25
    layer_overhead_s: float = 0.0
    step_overhead_s: float = 0.05
    # MoE (moe_cost.py): an expert's GEMM of `rows` rows takes the dense roofline x (rows + r0) / rows. Fitted
    # on 2 published MoE rows (one source, tools/bench/published_runs.py MOE_FIT_RUNS): it absorbs all the
    # MoE layer leaves out, not only small GEMMs; the rows added to check it (MOE_CHECK_RUNS) do not confirm it
    expert_rows_half: float = 1280.0
    comm_efficiency: float = 0.80  # NCCL bus bandwidth / link bandwidth (nccl-tests on DGX A100 / H100)
    hbm_efficiency: float = 0.80  # achieved / spec HBM bandwidth of streaming kernels


@dataclass(frozen=True)
class PassTime:
    """Seconds of one pass (forward or backward) of one layer or of the output layer."""

    gemm: float = 0.0
    attention: float = 0.0
    elementwise: float = 0.0
    overhead: float = 0.0

    @property
    def total(self) -> float:
        return self.gemm + self.attention + self.elementwise + self.overhead

    def __add__(self, other: PassTime) -> PassTime:
        return PassTime(
            self.gemm + other.gemm,
            self.attention + other.attention,
            self.elementwise + other.elementwise,
            self.overhead + other.overhead,
        )

    def scaled(self, k: float) -> PassTime:
        return PassTime(k * self.gemm, k * self.attention, k * self.elementwise, k * self.overhead)


def gemm_seconds(m: float, n: float, k: float, element_bytes: int, hw: Hardware, cal: Calibration) -> float:
    """An [m, k] x [k, n] product: its FLOPs at the GEMM peak plus its matrices' bytes at HBM bandwidth."""
    flops = 2.0 * m * n * k / (hw.peak_tflops * 1e12 * cal.gemm_peak_fraction)
    return flops + element_bytes * (m * k + k * n + m * n) / (hw.hbm_gbps * 1e9 * cal.hbm_efficiency)


# Bytes per element a fused FP8 linear reads and writes to quantise its operands (docs/fp8.md, "What a FP8 linear
# does per GEMM", the fused path), per recipe: (the input and the weight in the forward, the output gradient for
# the input gradient, what the weight gradient adds to it); the backward's cast-transposes of the weight (input
# gradient) and of the input (weight gradient) with their forward scales read 2 bytes and write 1 each
FP8_CAST_BYTES = {"tensorwise": (5, 5, 1), "delayed": (3, 3, 1), "blockwise": (3, 3, 3)}
FP8_TRANSPOSE_CAST_BYTES = 3


def fp8_gemm_seconds(m: float, n: float, k: float, out_bytes: int, hw: Hardware, cal: Calibration) -> float:
    """An [m, k] x [k, n] product of FP8 operands (1 byte an element) into `out_bytes` an output element: its
    FLOPs at `fp8_gemm_peak_fraction` of the FP8 peak plus its matrices' bytes at HBM bandwidth."""
    if hw.fp8_tflops is None:
        raise ValueError(
            "--fp8-format: the device has no FP8 tensor cores (compute capability below 8.9, where training "
            "refuses FP8): plan on an FP8 device (h100-80gb, h200, ...) or give --fp8-peak-tflops"
        )
    flops = 2.0 * m * n * k / (hw.fp8_tflops * 1e12 * cal.fp8_gemm_peak_fraction)
    return flops + (m * k + k * n + out_bytes * m * n) / (hw.hbm_gbps * 1e9 * cal.hbm_efficiency)


def linear_seconds(m: int, n: int, k: int, config, hw: Hardware, cal: Calibration) -> tuple[float, float]:
    """(forward, backward) GEMM seconds of a linear layer y [m, n] = x [m, k] W^T (W [n, k]): in the model's
    precision, the forward and twice it (input and weight gradients, the same three dimensions); under FP8
    (`config.fp8`), y = x W^T, dX = dY W (both in the model's dtype) and dW = dY^T x (fp32 for main_grad;
    in the model's precision with --no-fp8-wgrad) at the FP8 rate, plus the casts of x, W and dY."""
    element = dtype_bytes(config.params_dtype)
    recipe = config.fp8
    if recipe is None:
        seconds = gemm_seconds(m, n, k, element, hw, cal)
        return seconds, 2 * seconds
    per_byte = 1 / (hw.hbm_gbps * 1e9 * cal.hbm_efficiency)
    operands, grad, grad_for_wgrad = FP8_CAST_BYTES[recipe.recipe]
    forward = fp8_gemm_seconds(m, n, k, element, hw, cal) + operands * (m * k + n * k) * per_byte
    dgrad = fp8_gemm_seconds(m, k, n, element, hw, cal) + (grad * m * n + FP8_TRANSPOSE_CAST_BYTES * n * k) * per_byte
    if not recipe.wgrad:
        return forward, dgrad + gemm_seconds(n, k, m, element, hw, cal)
    casts = (grad_for_wgrad * m * n + FP8_TRANSPOSE_CAST_BYTES * m * k) * per_byte
    return forward, dgrad + fp8_gemm_seconds(n, k, m, 4, hw, cal) + casts


def gemm_efficiency(m: float, n: float, k: float, element_bytes: int, hw: Hardware, cal: Calibration) -> float:
    """Achieved / peak FLOP/s of that product."""
    return 2.0 * m * n * k / gemm_seconds(m, n, k, element_bytes, hw, cal) / (hw.peak_tflops * 1e12)


def layer_gemm_shapes(config, tokens: int, tp: int, mlp: bool = True) -> list[tuple[int, int, int]]:
    """(m, n, k) of a layer's forward GEMMs on one tp rank: QKV, output projection, MLP in and out
    (`mlp` False: without the MLP, as on an MoE layer)."""
    h, d, a, g, f = (
        config.hidden_size,
        config.kv_channels,
        config.num_attention_heads,
        config.num_query_groups,
        config.ffn_hidden_size,
    )
    mlp_in = (2 if config.swiglu else 1) * f
    attention = [(tokens, (a + 2 * g) * d // tp, h), (tokens, h, a * d // tp)]
    return attention + ([(tokens, mlp_in // tp, h), (tokens, h, f // tp)] if mlp else [])


def attention_time(
    config, kernel: str, batch: int, cp: int, tp: int, hw: Hardware, cal: Calibration
) -> tuple[PassTime, PassTime]:
    """(forward, backward) of the attention core of one layer: `batch` sequences, s / cp queries
    each against all s keys (context parallelism splits the queries), a / tp heads."""
    s, d = config.seq_length, config.kv_channels
    heads = config.num_attention_heads // tp
    queries = s // cp
    if kernel not in UNFUSED:
        flops = 2 * 2.0 * batch * heads * queries * s * d * 0.5  # scores and context, causal half
        seconds = flops / (hw.peak_tflops * 1e12 * cal.flash_fraction)
        return PassTime(attention=seconds), PassTime(attention=2.5 * seconds)
    element = dtype_bytes(config.params_dtype)
    gemm = 2 * batch * heads * gemm_seconds(queries, s, d, element, hw, cal)  # Q K^T and P V per head
    scores = batch * heads * queries * s
    dropout = config.attention_dropout > 0
    # forward: scale-mask-softmax reads and writes the scores; dropout reads them, writes them and a
    # 1-byte mask. Backward: dropout's gradient (gradient and mask in, gradient out), softmax's
    # (gradient and probabilities in, gradient out).
    forward_bytes = scores * (2 * element + (2 * element + 1 if dropout else 0))
    backward_bytes = scores * (3 * element + (2 * element + 1 if dropout else 0))
    bandwidth = hw.hbm_gbps * 1e9 * cal.hbm_efficiency
    return (
        PassTime(attention=gemm + forward_bytes / bandwidth),
        PassTime(attention=2 * gemm + backward_bytes / bandwidth),
    )


def elementwise_bytes(config, tokens: int, tp: int, mlp: bool = True) -> float:
    """Bytes one layer's forward reads and writes outside GEMMs and attention, on one tp rank:
    two norms (in, out), two dropout + residual adds (two in, one out, a 1-byte mask when dropout
    is on), the activation (GELU: f in, f out; SwiGLU: 2f in, f out) and rotary embedding on q and
    k (in, out). Norms and residuals run on tokens / tp under sequence parallelism. `mlp` False: without
    the activation (an MoE layer's experts have their own: moe_cost.py)."""
    h, f, d = config.hidden_size, config.ffn_hidden_size, config.kv_channels
    e = dtype_bytes(config.params_dtype)
    row_tokens = tokens // tp if config.sequence_parallel else tokens
    mask = 1 if config.hidden_dropout > 0 else 0
    per_row = 2 * (2 * h * e) + 2 * (3 * h * e + h * mask)
    activation = (3 if config.swiglu else 2) * f // tp * e if mlp else 0
    rotary = (
        2 * (config.num_attention_heads + config.num_query_groups) * d // tp * e
        if config.position_embedding_type == "rope"
        else 0
    )
    return row_tokens * per_row + tokens * (activation + rotary)


def layer_time(
    config, kernel: str, batch: int, cp: int, tp: int, hw: Hardware, cal: Calibration, mlp: bool = True
) -> tuple[PassTime, PassTime]:
    """(forward, backward) of one transformer layer on one rank; the backward costs twice the
    forward's GEMMs and elementwise bytes (input and weight gradients; gradients in and out; under FP8
    the linear layers' own backward GEMMs and casts: `linear_seconds`).
    `mlp` False: without the dense MLP (an MoE layer: moe_cost.py adds its experts)."""
    tokens = batch * config.seq_length // cp
    linears = [linear_seconds(m, n, k, config, hw, cal) for m, n, k in layer_gemm_shapes(config, tokens, tp, mlp)]
    elementwise = elementwise_bytes(config, tokens, tp, mlp) / (hw.hbm_gbps * 1e9 * cal.hbm_efficiency)
    attn_f, attn_b = attention_time(config, kernel, batch, cp, tp, hw, cal)
    overhead = cal.layer_overhead_s
    return (
        PassTime(gemm=sum(f for f, _ in linears), elementwise=elementwise, overhead=overhead) + attn_f,
        PassTime(gemm=sum(b for _, b in linears), elementwise=2 * elementwise, overhead=2 * overhead) + attn_b,
    )


def output_layer_time(
    config, vocab: int, tokens: int, tp: int, hw: Hardware, cal: Calibration
) -> tuple[PassTime, PassTime]:
    """(forward, backward) of the logits GEMM and the vocab-parallel cross entropy on fp32 logits:
    forward 20 bytes per logit (the cast writes 4, the max reads 4, exp reads and writes 8, the sum
    reads 4), backward 12 (the softmax gradient reads and writes 8, the cast back writes 2, rounded up).
    Fused (--cross-entropy-loss-fusion, its Triton reductions): the forward runs the three GEMMs (the
    gradients are computed there), the reductions read each logit once in the weights' dtype and the
    gradient kernel reads and writes it once; backward scales the stored weight gradient into
    main_grad (fp32: reads 8 bytes and writes 4 per weight element, per weight element)."""
    element = dtype_bytes(config.params_dtype)
    gemm = gemm_seconds(tokens, vocab // tp, config.hidden_size, element, hw, cal)
    per_byte = 1 / (hw.hbm_gbps * 1e9 * cal.hbm_efficiency)
    logits = tokens * vocab // tp * per_byte
    if config.cross_entropy_loss_fusion:
        weight_update = 12 * vocab // tp * config.hidden_size * per_byte
        return PassTime(gemm=3 * gemm, elementwise=3 * element * logits), PassTime(elementwise=weight_update)
    return PassTime(gemm=gemm, elementwise=20 * logits), PassTime(gemm=2 * gemm, elementwise=12 * logits)
