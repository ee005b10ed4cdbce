"""The few-step flow-matching schedule and its two update rules."""

from __future__ import annotations

import pytest
import torch

from cadence.config import StreamConfig
from cadence.runtime.sampler import Schedule, shift_sigma


def _sched(rule: str = "euler", shift: float = 5.0, ts=(1000.0, 750.0, 500.0, 250.0)) -> Schedule:
    return Schedule.from_config(StreamConfig(shift=shift, timesteps=ts, passes=len(ts), sampler=rule))


def test_shifted_sigmas_formula():
    s = _sched()
    assert s.passes == 4 and len(s.sigmas) == 5
    for got, t in zip(s.sigmas, (1000.0, 750.0, 500.0, 250.0)):
        u = t / 1000.0
        assert got == pytest.approx(5.0 * u / (1.0 + 4.0 * u), rel=1e-12)
    assert s.sigmas[0] == 1.0  # t = 1000 stays pure noise under any shift
    assert s.sigmas[-1] == 0.0
    # hand-computed: 0.75 -> 3.75/4 = 0.9375, 0.5 -> 2.5/3, 0.25 -> 1.25/2 = 0.625
    assert s.sigmas[1:4] == pytest.approx((0.9375, 2.5 / 3.0, 0.625), rel=1e-12)
    assert list(s.sigmas) == sorted(s.sigmas, reverse=True)
    assert s.timestep(1) == pytest.approx(937.5)
    assert shift_sigma(0.5, 1.0) == 0.5  # shift 1 is the identity


def _oracle(x0: torch.Tensor):
    """The exact velocity for x0: x = (1-s) x0 + s n  =>  v = n - x0 = (x - x0) / s."""
    return lambda x, s: (x - x0) / s


def _run(sched: Schedule, x0: torch.Tensor, noise: torch.Tensor, renoise=None) -> torch.Tensor:
    v_of = _oracle(x0)
    x = noise.clone()
    for i in range(sched.passes):
        x = sched.step(
            x, v_of(x, sched.sigmas[i]), i, None if renoise is None or i >= len(renoise) else renoise[i]
        )
    return x


def test_euler_exact_velocity_lands_on_x0():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(16, 1, 8, 8, generator=g)
    noise = torch.randn(16, 1, 8, 8, generator=g)
    out = _run(_sched("euler"), x0, noise)
    # float32 arithmetic over 4 steps of values O(1): error ~1e-7
    assert torch.allclose(out, x0, atol=1e-6, rtol=0)
    # a wrong velocity does not land on x0 (the test can fail)
    bad = _run(_sched("euler"), x0 + 0.1, noise)
    assert not torch.allclose(bad, x0, atol=1e-2)


def test_euler_intermediate_states_on_the_path():
    # after pass i, x is exactly (1 - sigma_{i+1}) x0 + sigma_{i+1} noise
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)
    s = _sched("euler", shift=3.0)
    v_of = _oracle(x0)
    x = noise.clone()
    for i in range(s.passes):
        x = s.step(x, v_of(x, s.sigmas[i]), i)
        nxt = s.sigmas[i + 1]
        assert torch.allclose(x, (1 - nxt) * x0 + nxt * noise, atol=1e-6)


def test_renoise_exact_velocity_lands_on_x0():
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(16, 1, 8, 8, generator=g)
    noise = torch.randn(16, 1, 8, 8, generator=g)
    renoise = torch.randn(3, 16, 1, 8, 8, generator=g)
    s = _sched("renoise")
    out = _run(s, x0, noise, renoise)
    assert torch.allclose(out, x0, atol=1e-6, rtol=0)
    # the intermediate state really is re-noised with the fresh noise
    x1 = s.step(noise, _oracle(x0)(noise, 1.0), 0, renoise[0])
    s1 = s.sigmas[1]
    assert torch.allclose(x1, (1 - s1) * x0 + s1 * renoise[0], atol=1e-6)


def test_renoise_needs_noise():
    s = _sched("renoise")
    x = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="noise"):
        s.step(x, x, 0, None)
    # the last pass steps to sigma 0 and needs no noise
    out = s.step(torch.ones(2, 2), torch.ones(2, 2), s.passes - 1, None)
    assert torch.allclose(out, torch.full((2, 2), 1.0 - s.sigmas[-2]))


def test_step_keeps_dtype():
    s = _sched("euler")
    x = torch.randn(3, 3).to(torch.bfloat16)
    assert s.step(x, x, 0).dtype == torch.bfloat16


# ---- the Self-Forcing family's table-based schedule (cadence.runtime.sampler.training_table) ------------


def _table_stream(**kw):
    from cadence.config import StreamConfig

    base = dict(timesteps=(1000.0, 750.0, 500.0, 250.0), shift=5.0, sampler="renoise", timestep_table=1000)
    base.update(kw)
    base.setdefault("passes", len(base["timesteps"]))
    return StreamConfig(**base)


def test_warped_table_schedule_equals_closed_form_to_float32():
    from cadence.runtime.sampler import Schedule, shift_sigma

    s = Schedule.from_config(_table_stream())
    closed = [shift_sigma(t / 1000, 5.0) for t in (1000, 750, 500, 250)]
    assert all(abs(s.timestep(i) - 1000 * s.sigmas[i]) < 1e-3 for i in range(4))  # float32 table rounding
    assert max(abs(a - b) for a, b in zip(s.sigmas[:4], closed)) < 1e-6
    assert s.sigmas[-1] == 0.0


def test_unwarped_table_schedule_model_sees_raw_timesteps():
    """CausVid: the model runs at 1000 / 757 / 522; the noise level is the table's nearest entry (~t/1000)."""
    from cadence.runtime.sampler import Schedule, training_table

    s = Schedule.from_config(
        _table_stream(timesteps=(1000.0, 757.0, 522.0), shift=8.0, warp_denoising_step=False)
    )
    assert [s.timestep(i) for i in range(3)] == [1000.0, 757.0, 522.0]
    sig, ts = training_table(1000, 8.0)
    for i, t in enumerate((1000.0, 757.0, 522.0)):
        k = int(torch.argmin((ts.double() - t).abs()))
        assert s.sigmas[i] == float(sig[k])
        assert abs(s.sigmas[i] - t / 1000) < 2e-3


def test_last_pass_at_zero_and_context_timestep():
    from cadence.runtime.sampler import Schedule, training_table

    s = Schedule.from_config(_table_stream(timesteps=(1000.0, 750.0, 500.0, 250.0, 0.0), context_noise=3.0))
    sig, _ = training_table(1000, 5.0)
    assert s.timestep(4) == 0.0 and s.sigmas[4] == float(sig[-1]) and s.sigmas[5] == 0.0
    ts = s.device_timesteps("cpu")
    assert ts.shape == (7,) and float(ts[5]) == 3.0 and float(ts[6]) == 0.0


def test_table_schedule_validation():
    from cadence.config import CadenceConfig
    from cadence.errors import ConfigError

    with pytest.raises(ConfigError, match=r"\(0, 1000\]"):
        CadenceConfig(stream=_table_stream(timesteps=(1000.0, 0.0), timestep_table=0))
    with pytest.raises(ConfigError, match=r"whole numbers <= 1000"):
        CadenceConfig(stream=_table_stream(timesteps=(1000.0, 750.5)))
    CadenceConfig(stream=_table_stream(timesteps=(1000.0, 0.0)))  # a last pass at 0 is fine with the table
