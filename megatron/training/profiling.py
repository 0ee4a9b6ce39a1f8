"""--profile: a torch.profiler trace on the --profile-ranks of the iterations after
--profile-step-start completed ones up to --profile-step-end (1-based start+1..end, as Megatron
counts), written beside the TensorBoard logs (Chrome trace JSON, opens in Perfetto
or chrome://tracing)."""

from __future__ import annotations

import os

import torch


class IterationProfiler:
    def __init__(self, config, rank: int, device: torch.device):
        self.config, self.rank, self.device = config, rank, device
        self.active = config.profile and rank in config.profile_ranks
        self.profiler = None
        self.path = None

    def before(self, iteration: int) -> None:
        if self.active and iteration - 1 == self.config.profile_step_start:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self.profiler.__enter__()

    def after(self, iteration: int) -> str | None:
        """Stops after iteration `end`; returns the trace's path when written."""
        if self.profiler is None or iteration < self.config.profile_step_end:
            return None
        return self.stop()

    def stop(self) -> str | None:
        if self.profiler is None:
            return None
        self.profiler.__exit__(None, None, None)
        directory = os.path.join(self.config.tensorboard_dir or ".", "profile")
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(
            directory,
            f"trace_rank{self.rank}_iters{self.config.profile_step_start}-{self.config.profile_step_end}.json",
        )
        self.profiler.export_chrome_trace(self.path)
        self.profiler = None
        return self.path
