"""Few-step flow-matching sampler with timestep shift (Self-Forcing-style 4-pass schedule).

Convention (Wan / rectified flow): x_sigma = (1 - sigma) * x0 + sigma * noise, and the network
predicts the velocity v = noise - x0. The schedule's timesteps (0..1000) are shifted:
sigma' = shift * sigma / (1 + (shift - 1) * sigma). Two update rules:

* ``euler``: x_next = x + (sigma_next - sigma) * v (the ODE step; deterministic given the noise);
* ``renoise``: x0 = x - sigma * v, then x_next = (1 - sigma_next) * x0 + sigma_next * fresh noise
  (Self-Forcing / CausVid few-step sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.config import StreamConfig


def shift_sigma(sigma: float, shift: float) -> float:
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


@dataclass(frozen=True)
class Schedule:
    """sigmas[i] is pass i's noise level; sigmas[i+1] (0 after the last) the level it steps to."""

    sigmas: tuple[float, ...]
    rule: str

    @classmethod
    def from_config(cls, s: StreamConfig) -> "Schedule":
        return cls(tuple(shift_sigma(t / 1000.0, s.shift) for t in s.timesteps) + (0.0,), s.sampler)

    @property
    def passes(self) -> int:
        return len(self.sigmas) - 1

    def timestep(self, i: int) -> float:
        """Model timestep (0..1000) of pass i."""
        return self.sigmas[i] * 1000.0

    def step(self, x: torch.Tensor, v: torch.Tensor, i: int, noise: torch.Tensor | None = None) -> torch.Tensor:
        """Advance x from sigmas[i] to sigmas[i+1] given the predicted velocity v (float32 math)."""
        s, s_next = self.sigmas[i], self.sigmas[i + 1]
        xf, vf = x.float(), v.float()
        if self.rule == "euler" or s_next == 0.0:  # the last renoise step is the same jump to x0
            out = xf + (s_next - s) * vf
        else:
            if noise is None:
                raise ValueError("renoise sampling needs fresh noise for every pass but the last")
            out = (1.0 - s_next) * (xf - s * vf) + s_next * noise.float()
        return out.to(x.dtype)
