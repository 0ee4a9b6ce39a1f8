"""The one rule for whether a layout fits a device: `fit_verdict`.

The planner keeps a layout, the start-up check starts it and tools/estimate_memory.py reports
it by this verdict. A rank's estimate comes in three layers (docs/memory.md, "The fit rule"):

- certain: weights, gradients, optimizer state and saved activations, equal to the measured
  bytes on every CPU layout;
- allocator-visible peak: the certain part and the transients our code allocates beside it
  (derived from its shapes), at the phase that peaks: what torch's caching allocator is asked for;
- allowances: what the trace cannot see or no GPU has measured, by name (fragmentation, the CUDA
  context, NCCL's buffers per communicator, the document mask, context parallelism's terms): the
  uncertain part, and the only margin.
  The full estimate (`total_bytes`) is the allocator-visible peak plus the allowances.

Verdicts, on the worst rank:

- "fits": the full estimate is within device memory; every allowance has its room.
- "fits with margin X": the certain part fits, the full estimate does not; X is the room the
  allocator-visible peak leaves for the allowances (negative when the derived transients
  alone overflow). It runs if the uncertain part is at most X. The start-up check starts it
  with a warning; the planner, which recommends, does not keep it.
- "does not fit": the certain part alone exceeds device memory; no allowance can be wrong
  enough for it to run. The start-up check refuses it.

No flat share of device memory is kept on top: Fujii et al.'s 80% of a total that counts no
allowance is a margin for exactly what our allowances name, and counting both dropped layouts
that ran (docs/memory.md gives the data).
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = float(1 << 30)

FITS = "fits"
MARGIN = "fits with margin"
DOES_NOT_FIT = "does not fit"
_ORDER = {FITS: 0, MARGIN: 1, DOES_NOT_FIT: 2}


@dataclass(frozen=True)
class FitVerdict:
    kind: str  # FITS, MARGIN or DOES_NOT_FIT
    pp_rank: int  # the rank that decides
    device_bytes: int
    certain_bytes: int
    visible_bytes: int  # allocator-visible peak
    allowances: dict[str, int]  # the uncertain part, by name (zeros left out), largest first

    @property
    def allowance_bytes(self) -> int:
        return sum(self.allowances.values())

    @property
    def total_bytes(self) -> int:
        return self.visible_bytes + self.allowance_bytes

    @property
    def margin_bytes(self) -> int:
        """The room the allocator-visible peak leaves for the allowances."""
        return self.device_bytes - self.visible_bytes

    @property
    def fits(self) -> bool:
        """What the planner keeps."""
        return self.kind == FITS

    @property
    def refused(self) -> bool:
        """What the start-up check refuses."""
        return self.kind == DOES_NOT_FIT

    @property
    def label(self) -> str:
        """ "fits", "fits with margin X GiB" or "does not fit"."""
        return f"{MARGIN} {self.margin_bytes / GIB:.2f} GiB" if self.kind == MARGIN else self.kind

    def describe(self) -> str:
        """The verdict and why, one line."""
        share = f"{self.total_bytes / self.device_bytes:.1%} of {self.device_bytes / GIB:.2f} GiB"
        named = ", ".join(f"{name} {nbytes / GIB:.2f}" for name, nbytes in self.allowances.items()) or "none"
        parts = (
            f"pipeline rank {self.pp_rank}: certain {self.certain_bytes / GIB:.2f} GiB, allocator-visible peak "
            f"{self.visible_bytes / GIB:.2f} GiB, allowances {self.allowance_bytes / GIB:.2f} GiB ({named})"
        )
        if self.kind == FITS:
            return f"{self.label}: {parts}; total {share}"
        if self.kind == MARGIN:
            return f"{self.label}: {parts}; total {share}: it runs if the allowances are at most the margin"
        return f"{self.label}: {parts}; the certain part alone exceeds the device"


def rank_verdict(rank, device_bytes: int) -> FitVerdict:
    """The verdict on one RankEstimate."""
    allowances = rank.uncertain()
    visible = rank.total_bytes - sum(allowances.values())
    if rank.certain_bytes > device_bytes:
        kind = DOES_NOT_FIT
    elif rank.total_bytes > device_bytes:
        kind = MARGIN
    else:
        kind = FITS
    return FitVerdict(kind, rank.pp_rank, device_bytes, rank.certain_bytes, visible, allowances)


def fit_verdict(estimate, device_bytes: int) -> FitVerdict:
    """The verdict on a MemoryEstimate: its worst rank's (the worse kind; then the larger certain
    part among refused ranks, else the larger full estimate)."""
    verdicts = [rank_verdict(r, device_bytes) for r in estimate.ranks]
    return max(verdicts, key=lambda v: (_ORDER[v.kind], v.certain_bytes if v.refused else v.total_bytes))
