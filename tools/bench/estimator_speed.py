#!/usr/bin/env python
"""How long the memory estimate and the layout planner take (they trace our modules with fake tensors).

    python tools/bench/estimator_speed.py

1. One estimate of Llama-3.1-405B (126 layers, hidden 16384, ffn 53248, 128 heads, 8 KV groups,
   vocab 128256, seq 8192, bf16) on 2048 GPUs: tp 8, pp 16, dp 16, micro batch 1, 128
   microbatches, distributed optimizer, CUDA kernels. Our layer split needs every pipeline
   rank's layer count to divide by the virtual stages, which 126 layers over pp 16 x v 8 cannot
   do, so the first and last ranks hold 7 layers and the others 8 (v 1). Timed cold (each
   distinct layer configuration traced once) and warm (traces cached, as the planner reuses them),
   after the one-time start-up of torch's fake tensors (printed apart).
2. The planner over every candidate layout of the same model on 1,024 GPUs, global batch 1,024
   (tp, cp, pp, virtual stages, micro batch 1/2/4/8, three recomputations, both optimizers): the
   number of layouts, of distinct traces, and the seconds. Cold: nothing traced before.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from megatron.core.distributed.model_chunk_buffers import DDPConfig  # noqa: E402
from megatron.core.parallel_config import ParallelConfig  # noqa: E402
from megatron.core.transformer.config import TransformerConfig  # noqa: E402
from megatron.planning import MemoryLayout, estimate_memory  # noqa: E402
from megatron.planning.planner import Search, enumerate_layouts, plan  # noqa: E402
from megatron.planning.step_time import Hardware  # noqa: E402
from megatron.planning.trace import trace_cache_clear, traces_run  # noqa: E402

GIB = 1 << 30
LLAMA_405B = TransformerConfig(
    num_layers=126,
    hidden_size=16384,
    ffn_hidden_size=53248,
    num_attention_heads=128,
    num_query_groups=8,
    vocab_size=128256,
    seq_length=8192,
    normalization="RMSNorm",
    position_embedding_type="rope",
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    params_dtype=torch.bfloat16,
    rotary_base=500000.0,
    rope_scaling=True,
)
TP, PP, DP = 8, 16, 16


def start_up() -> float:
    """Seconds of the first fake-tensor mode in a process (it imports torch's tracing stack once)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    started = time.perf_counter()
    with FakeTensorMode():
        pass
    return time.perf_counter() - started


def one_layout() -> tuple[float, float, float]:
    config = TransformerConfig(**{**LLAMA_405B.__dict__, "tensor_model_parallel_size": TP, "sequence_parallel": True})
    parallel = ParallelConfig(
        tp=TP, pp=PP, dp=DP, ddp=DDPConfig(use_distributed_optimizer=True), first_stage_layers=7, last_stage_layers=7
    )
    layout = MemoryLayout(parallel, micro_batch_size=1, num_microbatches=128)
    trace_cache_clear()
    started = time.perf_counter()
    estimate = estimate_memory(config, layout)
    cold = time.perf_counter() - started
    started = time.perf_counter()
    estimate_memory(config, layout)
    return cold, time.perf_counter() - started, estimate.max_total_bytes / GIB


def planner(num_gpus: int = 1024, global_batch: int = 1024) -> tuple[int, int, int, float, float]:
    search = Search()
    layouts = sum(1 for _ in enumerate_layouts(LLAMA_405B, num_gpus, global_batch, search, Hardware()))
    trace_cache_clear()
    started, cpu = time.perf_counter(), time.process_time()
    fitting, rejected, _ = plan(LLAMA_405B, num_gpus, global_batch, 80 * GIB, search=search)
    return layouts, len(fitting), traces_run(), time.perf_counter() - started, time.process_time() - cpu


def main() -> int:
    print(f"start-up: the first fake-tensor mode of a process imports torch's tracing stack: {start_up():.1f} s")
    cold, warm, gib = one_layout()
    print(
        f"Llama-3.1-405B, tp {TP} pp {PP} (7/8../8/7 layers) dp {DP}, seq 8192, micro batch 1: "
        f"estimate {cold:.2f} s cold, {warm:.3f} s warm (worst rank {gib:.1f} GiB)"
    )
    layouts, fitting, traces, seconds, cpu = planner()
    print(
        f"planner, Llama-3.1-405B on 1024 GPUs, global batch 1024: {layouts} layouts "
        f"({fitting} fit in 80 GiB), {traces} traces: {seconds:.1f} s wall, {cpu:.1f} s CPU "
        f"({1000 * seconds / layouts:.1f} ms per layout)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
