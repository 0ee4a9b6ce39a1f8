"""Process-group start-up: torchrun environment, or a one-rank run without a launcher."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist


def free_port() -> int:
    """A TCP port free on this machine now (for a rendezvous on 127.0.0.1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MINIMUM_TORCH = (2, 5)  # scaled_dot_product_attention(enable_gqa=...) appeared in torch 2.5


def check_torch_version(version: str = torch.__version__) -> None:
    """Refuse a torch older than the APIs this code uses, with one line."""
    major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    if (major, minor) < MINIMUM_TORCH:
        raise ValueError(
            f"torch {version} is too old: need torch >= {MINIMUM_TORCH[0]}.{MINIMUM_TORCH[1]} "
            "(scaled_dot_product_attention with enable_gqa)"
        )


def launch_environment() -> tuple[int, int, int]:
    """(rank, world size, local rank). Without torchrun's variables this is a one-rank run."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
        )
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


def select_device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def choose_backend(backend: str | None, device: torch.device) -> str:
    """nccl on CUDA, gloo otherwise, unless --distributed-backend says; refuse nccl without CUDA."""
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError("--distributed-backend nccl needs CUDA devices; use gloo on CPU")
    return backend


def init_distributed(backend: str, timeout_minutes: int, device: torch.device) -> None:
    """Initialise the default process group from the launcher's environment."""
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            timeout=datetime.timedelta(minutes=timeout_minutes),
            device_id=device if backend == "nccl" else None,
        )
