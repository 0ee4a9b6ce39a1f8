"""Loss scalers for fp16: constant, or dynamic (Megatron's rules).

Dynamic: on an iteration with inf/nan gradients the step is skipped and, once
`hysteresis` such iterations have been seen, the scale is halved (not below
min_scale). After `growth_interval` consecutive good iterations it doubles.
"""

from __future__ import annotations


class ConstantGradScaler:
    def __init__(self, scale: float):
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: the flag (--loss-scale) fixes the scale."""


class DynamicGradScaler:
    def __init__(
        self,
        initial_scale: float,
        min_scale: float,
        growth_interval: int,
        hysteresis: int,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
    ):
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self._good_steps = 0
        self._hysteresis_left = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self._good_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self._good_steps += 1
            if self._good_steps == self.growth_interval:
                self._good_steps = 0
                self._hysteresis_left = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        """Megatron's names: the scale and the two counters (checkpointed for exact resume)."""
        return {"scale": self.scale, "growth_tracker": self._good_steps, "hysteresis_tracker": self._hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._good_steps, self._hysteresis_left = state["growth_tracker"], state["hysteresis_tracker"]
