"""Few-step flow-matching sampler with timestep shift (Self-Forcing-style 4-pass schedule).

Convention (Wan / rectified flow): x_sigma = (1 - sigma) * x0 + sigma * noise, and the network
predicts the velocity v = noise - x0. Two update rules:

* ``euler``: x_next = x + (sigma_next - sigma) * v (the ODE step; deterministic given the noise);
* ``renoise``: x0 = x - sigma * v, then x_next = (1 - sigma_next) * x0 + sigma_next * fresh noise
  (Self-Forcing / CausVid few-step sampling; the last pass returns x0).

Where a pass's model timestep and noise level come from (``StreamConfig``):

* closed form (``timestep_table = 0``, Cadence's presets): sigma_i = shift(t_i / 1000) with
  shift(s) = shift*s / (1 + (shift-1)*s); the model runs at 1000 * sigma_i (``warp_denoising_step``)
  or at t_i with sigma_i = t_i / 1000 (no warp).
* the training table (``timestep_table = N``, the Self-Forcing family): the scheduler's N-step table
  sigma_k = shift(1 - k/N), k = 0..N-1, in float32, timesteps 1000 * sigma_k, zero-padded. Warped:
  pass i runs at table timestep N - t_i (Self-Forcing's ``timesteps[1000 - denoising_step_list]``);
  not warped: at t_i itself. Either way its noise level is the table sigma at the nearest table
  timestep, exactly as the family's ``FlowMatchScheduler`` / ``_convert_flow_pred_to_x0`` look it up.

The clean commit pass runs at ``context_noise`` (:meth:`Schedule.device_timesteps`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.config import StreamConfig


def shift_sigma(sigma: float, shift: float) -> float:
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def training_table(n: int, shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The n-step shifted flow-matching table (float32): (sigmas [n], timesteps [n] = 1000 * sigmas),
    sigma_k = shift(1 - k/n) for k = 0..n-1, the values Self-Forcing's ``FlowMatchScheduler(shift,
    sigma_min=0, extra_one_step=True).set_timesteps(n)`` holds."""
    s = torch.linspace(1.0, 0.0, n + 1, dtype=torch.float32)[:-1]
    s = shift * s / (1 + (shift - 1) * s)
    return s, s * 1000.0


@dataclass(frozen=True)
class Schedule:
    """sigmas[i] is pass i's noise level; sigmas[i+1] (0 after the last) the level it steps to.
    ``model_timesteps[i]`` is the timestep the network is given in pass i (default 1000 * sigmas[i]);
    ``context_timestep`` that of the clean commit pass."""

    sigmas: tuple[float, ...]
    rule: str
    model_timesteps: tuple[float, ...] | None = None
    context_timestep: float = 0.0

    @classmethod
    def from_config(cls, s: StreamConfig) -> Schedule:
        if not s.timestep_table:
            if s.warp_denoising_step:
                sig = tuple(shift_sigma(t / 1000.0, s.shift) for t in s.timesteps)
                return cls(sig + (0.0,), s.sampler, None, float(s.context_noise))
            sig = tuple(t / 1000.0 for t in s.timesteps)
            return cls(sig + (0.0,), s.sampler, tuple(float(t) for t in s.timesteps), float(s.context_noise))
        n = s.timestep_table
        sigmas, ts = training_table(n, s.shift)
        padded = torch.cat([ts, torch.zeros(1)])
        if s.warp_denoising_step:
            model_t = [padded[n - int(t)] for t in s.timesteps]
        else:
            model_t = [torch.tensor(float(t)) for t in s.timesteps]
        sig = tuple(float(sigmas[torch.argmin((ts.double() - float(t)).abs())]) for t in model_t)
        return cls(sig + (0.0,), s.sampler, tuple(float(t) for t in model_t), float(s.context_noise))

    @property
    def passes(self) -> int:
        return len(self.sigmas) - 1

    def timestep(self, i: int) -> float:
        """Model timestep (0..1000) of pass i."""
        return self.model_timesteps[i] if self.model_timesteps is not None else self.sigmas[i] * 1000.0

    def device_timesteps(self, device) -> torch.Tensor:
        """float32 [passes + 2] on `device`: the passes' model timesteps, the clean commit pass's
        (``context_timestep``, index ``passes``) and 0 (the sink pass, the last element), built once
        per generator. :func:`cadence.runtime.chunk.denoise_chunk` reads the commit pass's entry at
        index ``passes``; a tensor of only ``passes + 1`` entries ending in 0 works there too."""
        ts = [self.timestep(i) for i in range(self.passes)] + [self.context_timestep, 0.0]
        return torch.tensor(ts, dtype=torch.float32).to(device)

    def step(
        self, x: torch.Tensor, v: torch.Tensor, i: int, noise: torch.Tensor | None = None
    ) -> torch.Tensor:
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
