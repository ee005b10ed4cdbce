"""The clip step of a clip-streamed family in ``cadence bench step`` (FlashTalk: ``--model flashtalk``).

    cadence bench step --model flashtalk --layers 10 --fp8 --compile --profile
    cadence bench step --model flashtalk --layers 10 --tp 4 --emulate --fp8 --compile --profile  # rank 0 of 4

A clip family (``ClipStream``: SoulX-FlashTalk) has no K/V cache: one chunk is one bidirectional clip of
``clip_frames`` video frames (33: 9 latent frames, the first 2 the previous clip's motion latents), denoised in
``passes`` (4) whole-clip passes (``cadence.model.flashtalk.sample_clip``), then decoded, colour-matched and its
last frames re-encoded by the Wan VAE. This module times the DiT part, ``sample_clip``, on random inputs at the
family's geometry (the reference image's CLIP tokens, the I2V condition, motion latents, the clip's wav2vec2
windows, the prompt's K/V: all random; the VAE and the audio encoder are not run: they are one GPU's work
whatever the TP of the DiT, timed by ``cadence bench pipeline``). Under ``--tp N --emulate`` it is rank 0's
shard of the DiT with every collective a stand-in (``cadence.parallel.emulate``), exactly as for the K/V
step; the collectives, the comm estimate, the split, the floors and ``--profile`` are the same report.

Floors count the clip (:func:`clip_config`: a config whose "chunk" is the whole clip and whose keys are the
clip's own tokens), not the 7 new latent frames. ``--graphs`` (CUDA) also replays the clip from one CUDA graph
(its noise drawn beforehand: ``sample_clip`` takes the draws): the engine runs clips eagerly today, and at TP=4
the eager clip leaves the GPU idle between small kernels for a measurable share (the profile's "gaps").
"""

from __future__ import annotations

import torch

from cadence.config import CadenceConfig


def clip_latent_frames(cfg: CadenceConfig, clip_frames: int) -> int:
    return 1 + (clip_frames - 1) // cfg.vae.stride[0]


def clip_config(cfg: CadenceConfig, clip_frames: int) -> CadenceConfig:
    """`cfg` with its chunk made the whole clip (all its latent frames, keys = the clip's tokens, no sink, no
    clean pass): what :mod:`cadence.bench.floors` counts for one clip."""
    lf = clip_latent_frames(cfg, clip_frames)
    return cfg.with_overrides(
        stream={
            "latent_frames_per_chunk": lf,
            "window_chunks": 1,
            "frame_sink_chunks": 0,
            "sink_frames": 0,
            "commit": "last_pass",
        }  # fmt: skip
    )


def clip_inputs(
    cfg: CadenceConfig, model, device: torch.device, clip_frames: int, motion_frames: int
) -> dict:
    """Random inputs of one clip at the model's geometry (the keyword arguments of ``sample_clip`` but the
    noise): motion latents, the I2V condition, the prompt + image K/V, the audio windows, the timesteps."""
    from cadence.model.flashtalk import shifted_timesteps

    m, s = cfg.model, cfg.stream
    g = torch.Generator(device=device).manual_seed(1)
    lf = clip_latent_frames(cfg, clip_frames)
    lm = clip_latent_frames(cfg, motion_frames)
    h, w = s.height // cfg.vae.stride[1], s.width // cfg.vae.stride[2]
    dt = model.dtype

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dt)

    text = rnd(1, m.text_len, m.text_dim)
    image = rnd(1, m.image_tokens, m.image_dim) if m.image_tokens else None
    return {
        "motion": rnd(m.in_channels, lm, h, w),
        "cond": rnd(m.cond_channels, lf, h, w),
        "context": model.prepare_text(text, image) if image is not None else model.prepare_text(text),
        "audio": rnd(clip_frames, m.audio_window, m.audio_layers, m.audio_dim, scale=0.1),
        "timesteps": shifted_timesteps(s.timesteps, s.shift).to(device),
    }


def graphed_clip(step, device: torch.device, warmup: int, iters: int, rounds_of=None) -> dict:
    """The clip step `step` (static inputs: pre-drawn noise) captured in one CUDA graph and replayed: its times,
    and with `rounds_of` (the eager step) the graph speedup from interleaved rounds (``cadence.bench.rounds``).
    A capture that fails (an op that syncs with the host, ...) is reported, not raised: ``used`` False."""
    from cadence.bench.common import Timer
    from cadence.bench.rounds import compare, interleave

    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
    except RuntimeError as e:
        torch.cuda.synchronize(device)
        return {
            "used": False,
            "last": f"capture failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
        }
    timer = Timer(device)
    res = {
        "used": True,
        "times": timer.run(g.replay, warmup, iters),
        "captures": 1,
        "last": "replay",
        "graph": g,
    }
    if rounds_of is not None:
        t = interleave(
            {"eager": lambda: timer.run(rounds_of, 0, 1)[0], "graph": lambda: timer.run(g.replay, 0, 1)[0]}
        )
        r = compare(t, "eager", "graph")
        res["rounds"] = r.as_dict() if r is not None else None
    return res


@torch.no_grad()
def measure_clip(cfg, model, device, warmup: int, iters: int, *, clip_frames: int, motion_frames: int,
                 profile_iters: int = 1, collectives: bool = False, profile: dict | None = None,
                 progress: str | None = "clips", graphs: bool = False) -> dict:  # fmt: skip
    """Time ``sample_clip`` (median over `iters` eager clips), its region split from `profile_iters`
    instrumented ones, the collectives of one clip (`collectives`), with `graphs` (CUDA) the same clip replayed
    from one CUDA graph (:func:`graphed_clip`: its noise drawn beforehand), and with `profile` every kernel
    named (``cadence.bench.step_profile``: of the graph replay where it ran). The keys of
    ``cadence.bench.step.measure_step``'s result."""
    from cadence.bench.common import Timer
    from cadence.bench.step_report import split_regions
    from cadence.model.flashtalk import sample_clip
    from cadence.parallel.group import CollectiveLog
    from cadence.telemetry.spans import SpanRecorder

    inp = clip_inputs(cfg, model, device, clip_frames, motion_frames)
    noise = torch.Generator(device=device).manual_seed(0)

    def step():
        return sample_clip(
            model, noise, inp["motion"], inp["cond"], inp["context"], inp["audio"], inp["timesteps"]
        )

    timer = Timer(device)
    times = timer.run(step, warmup, iters, progress=progress)
    splits, totals = [], []
    for _ in range(max(1, profile_iters)):
        with SpanRecorder(device) as rec:
            totals.append(timer.run(step, 0, 1)[0])
        splits.append(rec.totals())
    log = None
    if collectives:
        with CollectiveLog() as log:
            step()
    graph = None
    if graphs and device.type == "cuda":
        draws = [torch.randn(inp["motion"].shape[0], *inp["cond"].shape[1:], generator=noise, device=device).to(
            inp["cond"].dtype) for _ in range(len(inp["timesteps"]))]  # fmt: skip
        args = (draws, inp["motion"], inp["cond"], inp["context"], inp["audio"], inp["timesteps"])
        graph = graphed_clip(lambda: sample_clip(model, *args), device, warmup, iters, rounds_of=step)
    prof = None
    if profile is not None:
        from cadence.bench.step_profile import profile_run

        replay = graph["graph"].replay if graph and graph["used"] else None
        prof = profile_run(
            step, device, model, scale=profile["scale"], floors=profile["floors"], replay=replay
        )
    if graph is not None:
        graph.pop("graph", None)
    return {
        "times": times,
        "region": split_regions(splits),
        "totals": totals,
        "host_sync": None,
        "cache_bytes": 0,
        "graph": graph,
        "graph_split": None,
        "log": log,
        "profile": prof,
    }
