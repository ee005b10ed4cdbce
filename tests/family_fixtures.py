"""Shared by the model-family parity tests: a fixture's tiny reference configuration as Cadence's config
overrides, and the relative error they compare with."""

import torch


def tiny_model(c: dict) -> dict:
    """The ``model`` overrides of a fixture's ``config`` (the reference's tiny random Wan)."""
    return dict(
        dim=c["dim"],
        num_heads=c["num_heads"],
        head_dim=c["dim"] // c["num_heads"],
        ffn_dim=c["ffn_dim"],
        num_layers=c["num_layers"],
        freq_dim=c["freq_dim"],
        text_dim=c["text_dim"],
        text_len=c["text_len"],
    )


def frame_size(c: dict) -> dict:
    """The ``stream`` height and width of a fixture's latent size (the VAE's 8x)."""
    return dict(height=c["latent_hw"][0] * 8, width=c["latent_hw"][1] * 8)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of ``a`` against ``b``, in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def feed_reference_noise(sess, noise: torch.Tensor, draws: torch.Tensor, frames_per_block: int) -> None:
    """Make ``sess`` step on a reference run's random numbers: its ``prepare_step`` keeps the session's own
    bookkeeping (cache placement, rebuild, audio, text) and swaps in block b's initial noise (``noise``:
    [frames, C, h, w]) and re-noising draws (``draws``: [blocks * (passes - 1), frames_per_block, C, h, w])."""
    from cadence.runtime.step import StepInputs

    F, p = frames_per_block, sess.gen.schedule.passes
    real_prepare = sess.prepare_step

    def prepare(audio):
        inp = real_prepare(audio)
        b = sess.index
        x0 = noise[b * F : (b + 1) * F].permute(1, 0, 2, 3).contiguous()
        ren = draws[b * (p - 1) : (b + 1) * (p - 1)].permute(0, 2, 1, 3, 4).contiguous()
        return StepInputs(x0, ren, inp.audio, inp.text)

    sess.prepare_step = prepare
