"""Module hooks that bring a chunk's buckets to what each module needs (optim_grads and
optim_grads_params), in the style of FSDP's pre-forward / pre-backward hooks.

Forward: before a module runs, the buckets holding its parameters (its own, and parameters
passed to it as arguments: the tied output layer gets the embedding) are gathered, and the
next module's buckets are prefetched (gathered asynchronously). With `reshard_after_forward`
a bucket is released after the last module of the forward that uses it; the first forward
records the order in which modules use buckets (a trace), later forwards release and
prefetch by it. Without a trace to follow (the first forward, or one that strays from it) the
last use is not known: a completed module's buckets are released when the next module with
parameters starts, unless it or a module enclosing it uses them (then gathered again if a later
module does), so such a forward too holds only the buckets in use, never the whole model.
Backward: a hook on each module's outputs runs before the module's backward; it gathers the
module's buckets again (and prefetches those of the module that completed before it in the
forward, whose backward comes next) and makes
their unsharded gradient buckets exist, since a linear layer adds its weight gradient into
`main_grad` itself. A bucket's parameters are released once all its gradients of the
microbatch are final (`ModelChunkBuffers`), or, without `reshard_after_forward` (pipeline
parallelism: a microbatch's forward and backward are far apart), after the iteration's last
microbatch: the parameters then stay gathered between forward and backward.
A forward rerun inside backward (activation recomputation) gathers what it needs and
releases nothing: the backward that follows still needs the parameters.
With a keep budget (`keep_gathered`, given by the auto placement from the device room it left
over) a bucket whose forward use is over stays gathered for its backward instead, as long as
the kept buckets fit the budget; past it, the kept bucket whose next use is furthest away is
released first. Backward runs the forward's modules in reverse, so that is the one kept
earliest: the buckets the forward used last, which backward needs first, are the ones kept.
"""

from __future__ import annotations

import contextlib

import torch


def _in_backward() -> bool:
    return torch._C._current_autograd_node() is not None


def _output_tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output] if output.requires_grad else []
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in _output_tensors(item)]
    return []


class ForwardTrace:
    """The buckets each module call of one forward used: in call order (for prefetching) and in
    completion order (a bucket is released when its last user completes)."""

    def __init__(self, calls: list, completions: list):
        self.calls, self.completions = calls, completions
        last = {}
        for index, buckets in enumerate(completions):
            for bucket in buckets:
                last[bucket] = index
        self.release_after = [[b for b in buckets if last[b] == index] for index, buckets in enumerate(completions)]
        # what to prefetch: the next call's buckets in forward, the previous completion's in backward,
        # skipping modules without parameters
        self.next_call = [next((c for c in calls[i + 1 :] if c), ()) for i in range(len(calls))]
        self.previous_completion = [
            next((c for c in reversed(completions[:i]) if c), ()) for i in range(len(completions))
        ]


class BucketHooks:
    """The hooks of one model chunk's modules over its buffer (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, buffer, reshard_after_forward: bool):
        self.buffer = buffer
        self.gathers = buffer.shards_params
        self.reshard = reshard_after_forward and self.gathers
        self.trace: ForwardTrace | None = None
        self.keep_bytes = 0  # gathered-bucket bytes a forward may leave for its backward
        self._kept: list = []  # buckets kept by the forward in progress, in the order kept
        self._finished: dict = {}  # off the trace: buckets of completed modules, not released yet (ordered)
        self._calls: list | None = None  # buckets per module call of the forward in progress
        self._completions: list = []
        self._stack: list = []
        self._on_trace = False
        self.handles = []
        for m in module.modules():
            own = self._ordered({buffer.bucket_of[p] for p in m.parameters(recurse=False) if p in buffer.bucket_of})
            self.handles.append(m.register_forward_pre_hook(self._pre_forward(own)))
            self.handles.append(m.register_forward_hook(self._post_forward()))

    def _ordered(self, buckets) -> tuple:
        return tuple(b for b in self.buffer.buckets if b in buckets)

    def _buckets_of_call(self, own: tuple, args) -> tuple:
        passed = {
            self.buffer.bucket_of[a] for a in args if isinstance(a, torch.nn.Parameter) and a in self.buffer.bucket_of
        }
        return self._ordered(passed.union(own)) if passed else own

    def keep_gathered(self, nbytes: int) -> None:
        """Let each forward leave up to `nbytes` of gathered buckets for its backward (only
        without pipelining: there every forward is followed by its own backward)."""
        self.keep_bytes = nbytes

    @contextlib.contextmanager
    def forward_pass(self):
        """Around the chunk's forward: trace it (the first time), release what is left after it
        (but the buckets kept for backward)."""
        self._calls, self._completions, self._stack, self._on_trace = [], [], [], self.trace is not None
        self._kept, self._finished = [], {}
        try:
            yield
        finally:
            if self.trace is None and self._calls is not None:
                self.trace = ForwardTrace(self._calls, self._completions)
            self._calls = None
            if self.reshard:
                kept = set(self._kept) if torch.is_grad_enabled() else set()
                for bucket in self.buffer.buckets:
                    if bucket not in kept:
                        bucket.release_params()

    def _release_or_keep(self, bucket) -> None:
        """After a bucket's last use in this forward (see the module docstring)."""
        nbytes = bucket.param_full.nbytes
        if not torch.is_grad_enabled() or nbytes > self.keep_bytes:
            bucket.release_params()
            return
        self._kept.append(bucket)
        while sum(b.param_full.nbytes for b in self._kept) > self.keep_bytes:
            self._kept.pop(0).release_params()

    def _release_finished(self) -> None:
        """Off the trace, as a module with parameters starts (on the stack now): release the
        completed modules' buckets that no module on the stack uses."""
        used = set().union(*self._stack)
        for bucket in [b for b in self._finished if b not in used]:
            bucket.release_params()
            del self._finished[bucket]

    def _pre_forward(self, own: tuple):
        def hook(_module, args):
            buckets = self._buckets_of_call(own, args)
            tracing = self._calls is not None and not _in_backward()
            if tracing:
                index = len(self._calls)
                self._calls.append(buckets)
                self._stack.append(buckets)
                self._on_trace = self._on_trace and index < len(self.trace.calls) and self.trace.calls[index] == buckets
            if not buckets or not self.gathers:
                return
            if tracing and self.reshard and not self._on_trace:
                self._release_finished()
            for bucket in buckets:
                bucket.gather_params()
            if tracing and self._on_trace:
                for bucket in self.trace.next_call[index]:
                    bucket.start_param_gather()

        return hook

    def _post_forward(self):
        def hook(_module, _args, output):
            if self._calls is None or _in_backward():
                return
            buckets = self._stack.pop()
            index = len(self._completions)
            self._completions.append(buckets)
            if self.reshard and self._on_trace:
                for bucket in self.trace.release_after[index]:
                    self._release_or_keep(bucket)
            elif self.reshard:
                self._finished.update(dict.fromkeys(buckets))
            if buckets and torch.is_grad_enabled():
                # backward runs the modules in reverse: prefetch what completed just before this one
                following = self.trace.previous_completion[index] if self.reshard and self._on_trace else ()
                for tensor in _output_tensors(output):
                    tensor.register_hook(self._pre_backward(buckets, following))

        return hook

    def _pre_backward(self, buckets: tuple, prefetch: tuple):
        def hook(grad):
            for bucket in buckets:
                self.buffer.prepare_grad(bucket)
                if self.gathers:
                    bucket.gather_params()
            for bucket in prefetch:
                bucket.start_param_gather()
            return grad

        return hook
