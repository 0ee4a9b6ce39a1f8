#!/usr/bin/env python
"""What one small collective costs on this machine's gloo, against a plain TCP round trip: the floor
under every multi-process test (docs/tests.md, "Where the suite's time goes").

    python tools/bench/gloo_latency.py [--worlds 2 4 8] [--numel 4 4096] [--repeat 300]

Each rank is a forked process with one intra-op thread, as in the tests (megatron/testing/forked_ranks.py).
A figure is the mean wall time of one call on rank 0, in microseconds, after a warm-up; the ratio
column divides it by the TCP round trip between two processes on 127.0.0.1 measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.testing.forked_ranks import run_distributed  # noqa: E402


def tcp_round_trip_us(repeat: int) -> float:
    """Mean round trip of one byte between this process and a forked echo over TCP loopback (no Nagle)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    if os.fork() == 0:
        echo = socket.create_connection(("127.0.0.1", port))
        echo.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(repeat + 1):
            echo.sendall(echo.recv(1))
        os._exit(0)
    peer, _ = server.accept()
    peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    peer.sendall(b"x")
    peer.recv(1)  # the echo is up
    start = time.perf_counter()
    for _ in range(repeat):
        peer.sendall(b"x")
        peer.recv(1)
    seconds = time.perf_counter() - start
    os.wait()
    return seconds / repeat * 1e6


def collectives(numel: int, world: int) -> dict:
    """name -> a call of that collective on `numel` floats per rank."""
    tensor, gathered = torch.ones(numel), torch.empty(numel * world)
    return {
        "all_reduce": lambda: dist.all_reduce(tensor),
        "all_gather": lambda: dist.all_gather(list(gathered.chunk(world)), tensor),
        "broadcast": lambda: dist.broadcast(tensor, 0),
        "barrier": dist.barrier,
    }


def time_collectives(rank: int, sizes: list[int], repeat: int) -> list[tuple[int, str, float]]:
    rows = []
    for numel in sizes:
        for name, call in collectives(numel, dist.get_world_size()).items():
            for _ in range(10):
                call()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(repeat):
                call()
            rows.append((numel, name, (time.perf_counter() - start) / repeat * 1e6))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8], help="ranks per run (each >= 2)")
    parser.add_argument("--numel", type=int, nargs="+", default=[4, 4096], help="floats per rank")
    parser.add_argument("--repeat", type=int, default=300, help="calls timed per collective")
    args = parser.parse_args()
    if min(args.worlds) < 2 or min(args.numel) < 1 or args.repeat < 1:
        parser.error("--worlds must be >= 2, --numel and --repeat >= 1")
    rtt = tcp_round_trip_us(args.repeat)
    print(f"TCP round trip on 127.0.0.1: {rtt:.0f} us ({os.cpu_count()} CPUs)")
    print(f"{'ranks':>5} {'floats':>7} {'collective':<11} {'us':>8} {'/ RTT':>7}")
    for world in args.worlds:
        for numel, name, micros in run_distributed(world, time_collectives, args.numel, args.repeat)[0]:
            print(f"{world:>5} {numel:>7} {name:<11} {micros:>8.0f} {micros / rtt:>7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
