#!/usr/bin/env python
"""Peak extra memory and time of initialising one rank's shard: full tensor then slice (old) vs tiles (ours).

    OMP_NUM_THREADS=1 python tools/bench/init_memory.py [--hidden 4096] [--ffn 14336] [--repeats 3]

The tensors of one Llama-3-8B MLP layer in bf16: fc1 (SwiGLU gate/up stacked,
[2 ffn, hidden], column-parallel: dim 0, stacked 2) and fc2 ([hidden, ffn],
row-parallel: dim 1), for tp 1, 2, 4 and 8. Each tp rank is simulated in this
process by its ShardSpec (rank 0; every rank draws about the same number of tiles).

- old: the former `full_tensor` (one generator over the whole fp32 tensor), then
  `ShardSpec.shard` and a cast to the parameter dtype;
- ours: `sharding.initialize_` (tiles of TILE_ELEMENTS overlapping the shard).

Peak extra memory is the rise of the process's peak resident set (VmHWM, reset
through /proc/self/clear_refs; Linux, glibc) above the resident set before the
call, with the shard already allocated and touched and freed heap memory trimmed: torch's CPU allocations are
invisible to tracemalloc, but a resident page is a resident page. Time is the
best of --repeats. Both paths give layout-independent values, though different
ones (a tile's seed differs from the whole tensor's).
"""

from __future__ import annotations

import argparse
import ctypes
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from megatron.core.tensor_parallel.initialization import InitSpec, ShardSpec, initialize_, seed_for  # noqa: E402

MIB = float(1 << 20)
LIBC = ctypes.CDLL("libc.so.6")
TPS = (1, 2, 4, 8)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.M).group(1))


def peak_extra_bytes(fn) -> int:
    """Peak resident bytes `fn()` adds above the current resident set. Freed heap pages are
    first given back (malloc_trim), else a reused free block would hide an allocation."""
    LIBC.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current VmRSS
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) * 1024


def old_initialize(param: torch.Tensor, spec: InitSpec, seed: int, name: str) -> None:
    """The former path: the full fp32 tensor from one generator on every rank, then this rank's slice."""
    generator = torch.Generator()
    generator.manual_seed(seed_for(seed, name))
    full = torch.empty(spec.full_shape)
    full.normal_(0.0, spec.std, generator=generator)
    param.copy_(spec.shard.shard(full).to(param.dtype))


def measure(init, spec: InitSpec, repeats: int) -> tuple[int, float]:
    shape = list(spec.full_shape)
    shape[spec.shard.dim] //= spec.shard.num_shards
    param = torch.zeros(shape, dtype=torch.bfloat16)  # allocated and touched before measuring
    peak = peak_extra_bytes(lambda: init(param, spec, 1234, "mlp.fc"))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        init(param, spec, 1234, "mlp.fc")
        best = min(best, time.perf_counter() - start)
    return peak, best


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    tensors = {
        "fc1 (gate/up, dim 0)": ((2 * args.ffn, args.hidden), 0, 2),
        "fc2 (dim 1)": ((args.hidden, args.ffn), 1, 1),
    }
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, bf16 parameters, rank 0 of tp\n")
    print("| tensor | tp | shard MiB | peak extra MiB old | ours | old / ours | time s old | ours | old / ours |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, (shape, dim, stacked) in tensors.items():
        for tp in TPS:
            spec = InitSpec(shape, shard=ShardSpec(dim=dim, num_shards=tp, rank=0, stacked=stacked))
            old_peak, old_s = measure(old_initialize, spec, args.repeats)
            new_peak, new_s = measure(initialize_, spec, args.repeats)
            shard_mib = 2 * shape[0] * shape[1] / tp / MIB
            print(
                f"| {label} | {tp} | {shard_mib:.0f} | {old_peak / MIB:.1f} | {new_peak / MIB:.1f} | "
                f"{old_peak / new_peak:.0f}x | {old_s:.2f} | {new_s:.2f} | {old_s / new_s:.2f}x |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
