"""Train the default character: a small streaming VAE and a chunk-causal DiT on synthetic talking faces.

    cadence train --out /tmp/character --minutes 12 --device cuda     # one H200, the shipped weights
    cadence train --out /tmp/toy --toy                                # CPU, seconds (tests use this)

Three phases, each bounded by steps and by wall time (the run fits ``--minutes``):

1. **Data** (``cadence.train.data``): ``clips`` stylised faces from the *train* split, each
   ``1 + 4 * latents`` frames (frame 0 is the reference image) with synthetic speech; the mouth opens
   with the speech's loudness. Rendered on a CPU process pool, kept as uint8 on the device.
2. **VAE**: the Wan-architecture encoder + decoder (``cadence.model.vae.WanVAE`` at a small width) and
   the tiny streaming decoder (``cadence.model.taehv.TAEHV`` with a pixel shuffle) trained together on
   ``1 + 4k``-frame segments: L1 + MSE reconstruction for both decoders, the encoder's posterior mean
   as the latent (a deterministic autoencoder) with a small L2 pull on it and latent noise (std
   ``latent_noise`` x the batch's latent std) before the decoders, so that they tolerate the
   diffusion model's errors. Then every clip is encoded and the per-channel latent mean / std are
   stored in the VAE config (the diffusion model works on normalised latents).
3. **DiT** (``cadence.model.dit.WanDiT``, the engine's own model, through its reference forward
   ``forward_full`` with a mask): "clean context, noisy current chunk". One training sequence is
   ``[sink | c_1 .. c_{W-1} | n_1 .. n_W]``: the reference latent (t = 0), W - 1 clean chunks (t = 0)
   and noisy copies of W chunks laid at their clean copies' RoPE positions. The mask gives each
   clean chunk the sink and the clean chunks before it (what the cache holds after a clean-pass
   commit), and each noisy chunk n_i the sink, c_1 .. c_{i-1} and itself: exactly what the ring cache
   shows chunk i of a stream while the window fills, and (with the sink following at the window's
   edge) in steady state. The loss is flow matching on the noisy chunks (v = noise - x0), with
   timesteps drawn half from the 4 inference timesteps and half from the shifted uniform; the
   audio of each chunk (4 tokens, one per video frame) and a random prompt go in as in serving.
   The weights kept are an exponential moving average.

Writes ``<out>/dit.safetensors``, ``<out>/vae/`` (diffusers-style ``config.json`` +
``diffusion_pytorch_model.safetensors`` for the Wan VAE, ``taehv.json`` + ``taehv.safetensors``),
``<out>/train_log.json`` (losses, steps, times, device) in float16 (weights) and float32 (stats).
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from cadence.config import AUDIO_SAMPLE_RATE, CadenceConfig, get_preset

PROMPTS = (
    "a person talking to the camera",
    "a cartoon character speaking",
    "a friendly face",
    "hello there",
    "someone telling a story",
    "a talking head",
    "an animated portrait",
    "a character in a video call",
)


@dataclass
class TrainConfig:
    preset: str = "character"
    overrides: dict = field(default_factory=dict)  # CadenceConfig.with_overrides sections (toy sizes)
    clips: int = 1536
    latents: int = 12  # latent frames per clip after the reference: 1 + 4 * latents frames
    seed: int = 0
    workers: int = 0  # data processes (0: all CPUs)
    # VAE
    vae_steps: int = 4000
    vae_batch: int = 12
    vae_segment: int = 3  # latent frames per training segment (after its first frame)
    vae_lr: float = 1e-3
    vae_minutes: float = 3.5
    latent_noise: float = 0.1
    latent_l2: float = 1e-4
    # DiT
    dit_steps: int = 20000
    dit_batch: int = 64
    dit_lr: float = 4e-4
    dit_minutes: float = 6.0
    ema: float = 0.999
    context_noise: float = 0.4  # per sample, noise of std U(0, this) on the clean context latents:
    # the model learns to lean on the sink where its own past is off
    # (exposure bias: a stream conditions on generated chunks)
    init: str | None = None  # a previous run's folder: keep its VAE, start the DiT from its weights
    window: int | None = None  # training window (chunks) if not the preset's stream.window_chunks
    log_every: int = 100


# ---- data -------------------------------------------------------------------------------------------


def _render(args):
    seed, n_frames, h, w = args
    from cadence.train.data import make_clip

    clip = make_clip(seed, n_frames / 24.0, height=h, width=w, speech="synthetic", split="train")
    return clip.frames, clip.audio


def make_dataset(n: int, n_frames: int, height: int, width: int, seed: int, workers: int = 0):
    """n train-split clips -> (frames uint8 [n, T, H, W, 3], audio float32 [n, T * 2000], seeds)."""
    import multiprocessing as mp
    import os

    rng = np.random.default_rng(seed)
    from cadence.train.data import TEST_SEED_BASE

    seeds = rng.choice(TEST_SEED_BASE, size=n, replace=False).tolist()
    jobs = [(s, n_frames, height, width) for s in seeds]
    workers = workers or max(1, min(32, os.cpu_count() or 1))
    if workers == 1 or n < 8:
        out = [_render(j) for j in jobs]
    else:
        with mp.get_context("fork").Pool(workers) as pool:
            out = pool.map(_render, jobs, chunksize=max(1, n // (4 * workers)))
    frames = np.stack([o[0] for o in out])
    audio = np.stack([o[1] for o in out])
    return frames, audio, seeds


def to_video(frames_u8: torch.Tensor) -> torch.Tensor:
    """uint8 [B, T, H, W, 3] -> float [B, 3, T, H, W] in [-1, 1]."""
    return frames_u8.permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0


# ---- phases -----------------------------------------------------------------------------------------


class _Clock:
    def __init__(self, minutes: float):
        self.t0, self.limit = time.perf_counter(), 60.0 * minutes

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def done(self) -> bool:
        return self.elapsed >= self.limit


def _progress(phase: str, step: int, total: int, loss: float, clock: _Clock) -> None:
    print(
        f"\r{phase}: step {step}/{total} loss {loss:.4f} ({clock.elapsed:.0f}s)",
        end="",
        file=sys.stderr,
        flush=True,
    )


def _lr(step: int, total: int, base: float, warmup: int = 200) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (0.1 + 0.45 * (1 + math.cos(math.pi * p)))


def train_vae(tc: TrainConfig, cfg: CadenceConfig, frames: torch.Tensor, device, log: dict):
    """Phase 2. frames uint8 [N, T, H, W, 3] on `device`. Returns (wan, taehv) in eval mode."""
    from cadence.engine.session import build_vae_modules

    wan, taehv = build_vae_modules(cfg)
    wan.to(device).train()
    taehv.to(device).train()
    params = list(wan.parameters()) + list(taehv.parameters())
    opt = torch.optim.AdamW(params, lr=tc.vae_lr, weight_decay=0.0, betas=(0.9, 0.99))
    g = torch.Generator().manual_seed(tc.seed + 1)
    st = cfg.vae.stride[0]
    seg = 1 + st * tc.vae_segment
    n, t_all = frames.shape[:2]
    clock = _Clock(tc.vae_minutes)
    amp = device.type == "cuda"
    losses = []
    step = 0
    for step in range(tc.vae_steps):
        if clock.done():
            break
        idx = torch.randint(n, (tc.vae_batch,), generator=g)
        # segments start on a chunk boundary (frame 0 or 1 + 4j) so the causal start matches streaming
        starts = torch.randint(0, (t_all - seg) // st + 1, (tc.vae_batch,), generator=g) * st
        clip = torch.stack([frames[i, s : s + seg] for i, s in zip(idx.tolist(), starts.tolist())])
        x = to_video(clip.to(device))
        for group in opt.param_groups:
            group["lr"] = _lr(step, tc.vae_steps, tc.vae_lr)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            mu = wan.encode_with_grad(x)
            noisy = mu + tc.latent_noise * mu.detach().std() * torch.randn_like(mu)
            rec_wan = wan.stream().decode_with_grad(noisy)
            rec_tae = taehv._run(noisy, [None] * taehv.n_slots, first=True)
        rec_wan, rec_tae = rec_wan.float(), rec_tae.float()
        loss = (
            F.l1_loss(rec_wan, x)
            + F.mse_loss(rec_wan, x)
            + F.l1_loss(rec_tae, x)
            + F.mse_loss(rec_tae, x)
            + tc.latent_l2 * mu.float().pow(2).mean()
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(loss.item())
        if step % tc.log_every == 0:
            _progress("vae", step, tc.vae_steps, float(np.mean(losses[-tc.log_every :])), clock)
    print(file=sys.stderr)
    log["vae"] = {
        "steps": step + 1 if losses else 0,
        "seconds": clock.elapsed,
        "loss_first": losses[:5],
        "loss_last_100": float(np.mean(losses[-100:])) if losses else None,
        "segment_frames": seg,
        "batch": tc.vae_batch,
    }
    return wan.eval(), taehv.eval()


@torch.no_grad()
def encode_all(wan, frames: torch.Tensor, device, batch: int = 32) -> torch.Tensor:
    """Raw latents [N, z, 1 + latents, h, w] (float32) of every clip."""
    out = []
    for i in range(0, frames.shape[0], batch):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out.append(wan.encode(to_video(frames[i : i + batch].to(device))).float())
    return torch.cat(out)


@torch.no_grad()
def vae_eval(wan, taehv, frames: torch.Tensor, device) -> dict:
    """Reconstruction PSNR (dB) of both decoders on up to 8 clips, streamed chunk by chunk."""
    x = to_video(frames[:8].to(device))
    lat = wan.encode(x)
    res = {}
    for name, dec in (("wan", wan.stream()), ("taehv", taehv.stream())):
        parts = [dec.decode_chunk(lat[:, :, :1])] + [
            dec.decode_chunk(lat[:, :, j : j + 1]) for j in range(1, lat.shape[2])
        ]
        rec = torch.cat(parts, 2).float().clamp(-1, 1)
        mse = F.mse_loss(rec, x).item()
        res[f"psnr_{name}_db"] = 10 * math.log10(4.0 / max(mse, 1e-12))
    return res


def chunk_audio(audio: torch.Tensor, n_latents: int, spf: int) -> torch.Tensor:
    """Per clip audio [N, samples] -> per latent frame j >= 1 the samples of its video frames
    4(j-1)+1 .. 4j: [N, n_latents, 4 * spf] (the reference frame 0 has no chunk)."""
    start = spf  # frame 1
    a = audio[:, start : start + n_latents * 4 * spf]
    return a.reshape(audio.shape[0], n_latents, 4 * spf)


def sequence_layout(window: int, tokens_per_frame: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE frame positions [2W] and the token mask [2W*tpf, 2W*tpf] (True = attend) of the training
    sequence ``[sink | c_1 .. c_{W-1} | n_1 .. n_W]`` (see the module docstring). tests/test_train.py
    checks that a noisy chunk's output under this layout equals the engine's cached stream."""
    W = window
    nf = 2 * W
    pos = torch.tensor([0] + list(range(1, W)) + list(range(1, W + 1)), device=device)
    fm = torch.zeros(nf, nf, dtype=torch.bool)
    fm[0, 0] = True
    for j in range(1, W):  # clean c_j (frame j): sink + c_1..c_j
        fm[j, 0] = True
        fm[j, 1 : j + 1] = True
    for i in range(1, W + 1):  # noisy n_i (frame W - 1 + i): sink + c_1..c_{i-1} + itself
        q = W - 1 + i
        fm[q, 0] = True
        fm[q, 1:i] = True
        fm[q, q] = True
    mask = fm.repeat_interleave(tokens_per_frame, 0).repeat_interleave(tokens_per_frame, 1).to(device)
    return pos, mask


def train_dit(
    tc: TrainConfig, cfg: CadenceConfig, lat: torch.Tensor, audio_chunks: torch.Tensor, device, log: dict
):
    """Phase 3. lat normalised [N, z, 1 + L, h, w] on device; audio_chunks [N, L, 8000] on device."""
    model, ema, batches = _dit_setup(tc, cfg, lat, audio_chunks, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.dit_lr, weight_decay=0.01, betas=(0.9, 0.99))
    clock = _Clock(tc.dit_minutes)
    amp = device.type == "cuda"
    losses = []
    step = 0
    W = batches.W
    for step in range(tc.dit_steps):
        if clock.done():
            break
        x, t, text, aud, target = batches.draw()
        for group in opt.param_groups:
            group["lr"] = _lr(step, tc.dit_steps, tc.dit_lr)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            out = model.forward_full(x, t, text, aud, mask=batches.mask, frame_positions=batches.pos)
        v = out[:, :, W:].float()
        loss = F.mse_loss(v, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        with torch.no_grad():
            d = min(tc.ema, (1 + step) / (10 + step))
            for pe, pm in zip(ema.parameters(), model.parameters()):
                pe.lerp_(pm.detach(), 1 - d)
        losses.append(loss.item())
        if step % tc.log_every == 0:
            _progress("dit", step, tc.dit_steps, float(np.mean(losses[-tc.log_every :])), clock)
    print(file=sys.stderr)
    log["dit"] = {
        "steps": step + 1 if losses else 0,
        "seconds": clock.elapsed,
        "loss_first": losses[:5],
        "loss_last_100": float(np.mean(losses[-100:])) if losses else None,
        "batch": tc.dit_batch,
        "sequence_tokens": 2 * W * batches.tpf,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
    }
    return ema


def _dit_setup(tc: TrainConfig, cfg: CadenceConfig, lat: torch.Tensor, audio_chunks: torch.Tensor, device):
    """The model to train (random, or ``tc.init``'s weights), its EMA copy, and the batch maker."""
    from cadence.model.weights import build_model

    model = build_model(cfg, device, torch.float32, seed=tc.seed)
    if tc.init:
        from cadence.model.weights import load_weights

        load_weights(model, Path(tc.init) / "dit.safetensors")
    model.train().requires_grad_(True)  # built for inference (no grad)
    ema = copy.deepcopy(model).eval()
    for p in ema.parameters():
        p.requires_grad_(False)
    return model, ema, _DitBatches(tc, cfg, lat, audio_chunks, device)


class _DitBatches:
    """Training sequences for :func:`train_dit`: the sink, W - 1 context chunks (clean, or noised by
    ``tc.context_noise``) and W noisy chunks of a random window of a random clip (``sequence_layout``), at noise
    levels half the inference sigmas and half shifted-uniform; the target is the flow ``noise - x0``."""

    def __init__(self, tc: TrainConfig, cfg: CadenceConfig, lat, audio_chunks, device):
        from cadence.model.audio import AudioFeatures
        from cadence.model.text import ByteTextEncoder
        from cadence.runtime.sampler import Schedule

        self.tc, self.cfg, self.lat, self.audio_chunks, self.device = tc, cfg, lat, audio_chunks, device
        self.feats = AudioFeatures(cfg, device)
        self.texts = torch.stack([ByteTextEncoder(cfg.model)(p) for p in PROMPTS]).to(device)
        sched = Schedule.from_config(cfg.stream)
        self.infer_sigmas = torch.tensor(sched.sigmas[:-1], device=device)
        self.W = W = tc.window or cfg.stream.window_chunks
        n, _, f_all, h, w = lat.shape
        self.n, self.L = n, f_all - 1
        if self.L < W:
            raise ValueError(f"clips have {self.L} latent frames after the reference; the window needs {W}")
        self.tpf = (h // cfg.model.patch[1]) * (w // cfg.model.patch[2])
        self.pos, self.mask = sequence_layout(W, self.tpf, device)
        self.silence = self.feats(
            torch.zeros(self.feats.samples_per_frame, device=device)
        )  # [1, A, audio_dim]
        self.g = torch.Generator(device=device).manual_seed(tc.seed + 2)

    def draw(self):
        """One batch: (x, t, text, audio, target)."""
        tc, cfg, lat, device, g, W, silence = (
            self.tc,
            self.cfg,
            self.lat,
            self.device,
            self.g,
            self.W,
            self.silence,
        )
        B = tc.dit_batch
        idx = torch.randint(self.n, (B,), device=device, generator=g)
        off = torch.randint(
            0, self.L - W + 1, (B,), device=device, generator=g
        )  # window: latents off+1..off+W
        ar = torch.arange(W, device=device)
        win_idx = off[:, None] + 1 + ar[None]  # [B, W] latent indices
        x0 = lat[idx[:, None], :, win_idx].permute(0, 2, 1, 3, 4)  # [B, z, W, h, w]
        sink = lat[idx, :, :1]  # [B, z, 1, h, w]
        a = self.audio_chunks[idx[:, None], win_idx - 1]  # [B, W, 8000]
        af = self.feats(a.reshape(-1)).reshape(B, W, *silence.shape[1:])  # [B, W, A, D]
        # noise levels: half the inference sigmas, half shifted-uniform
        pick = self.infer_sigmas[torch.randint(len(self.infer_sigmas), (B, W), device=device, generator=g)]
        u = torch.rand(B, W, device=device, generator=g)
        uni = cfg.stream.shift * u / (1 + (cfg.stream.shift - 1) * u)
        sig = torch.where(torch.rand(B, W, device=device, generator=g) < 0.5, pick, uni)
        noise = torch.randn(x0.shape, device=device, generator=g)
        s5 = sig[:, None, :, None, None]
        xt = (1 - s5) * x0 + s5 * noise
        ctx = x0[:, :, : W - 1]
        if tc.context_noise:
            amp_ctx = tc.context_noise * torch.rand(B, 1, 1, 1, 1, device=device, generator=g)
            ctx = ctx + amp_ctx * torch.randn(ctx.shape, device=device, generator=g)
        x = torch.cat([sink, ctx, xt], 2)
        t = torch.cat([torch.zeros(B, W, device=device), 1000.0 * sig], 1)
        aud = torch.cat([silence[None].expand(B, 1, *silence.shape[1:]), af[:, : W - 1], af], 1)
        text = self.texts[torch.randint(len(PROMPTS), (B,), device=device, generator=g)]
        return x, t, text, aud, noise - x0


def save(out: Path, cfg: CadenceConfig, wan, taehv, dit, lat_mean, lat_std, log: dict) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    vdir = out / "vae"
    vdir.mkdir(exist_ok=True)
    vcfg = dict(
        wan.config, latents_mean=[float(x) for x in lat_mean], latents_std=[float(x) for x in lat_std]
    )
    (vdir / "config.json").write_text(json.dumps(vcfg, indent=1) + "\n")

    def half(sd):
        return {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in sd.items()}

    save_file(half(wan.state_dict()), str(vdir / "diffusion_pytorch_model.safetensors"))
    (vdir / "taehv.json").write_text(
        json.dumps(
            {
                "z_dim": taehv.z_dim,
                "stride": list(taehv.stride),
                "channels": list(taehv.channels),
                "shuffle": taehv.shuffle,
            }
        )
        + "\n"
    )
    save_file(half(taehv.state_dict()), str(vdir / "taehv.safetensors"))
    save_file(half(dit.state_dict()), str(out / "dit.safetensors"))
    (out / "train_log.json").write_text(json.dumps(log, indent=1) + "\n")


def train(
    tc: TrainConfig, out: Path, device: str | torch.device = "cpu", minutes: float | None = None
) -> dict:
    """All three phases; returns the log (also written to ``out/train_log.json``)."""
    device = torch.device(device)
    if (
        minutes is not None
    ):  # split a total budget: data ~1 min, VAE 35%, DiT the rest (all of it with --init)
        share = 0.0 if tc.init else 0.35
        tc.vae_minutes = share * max(minutes - 1.0, 0.1)
        tc.dit_minutes = (1 - share) * max(minutes - 1.0, 0.1) - 0.1
    torch.manual_seed(tc.seed)
    cfg = get_preset(tc.preset)
    if tc.overrides:
        cfg = cfg.with_overrides(**tc.overrides)
    # random-weight sources only: the weights are what we are making
    cfg = cfg.with_overrides(model={"weights": None}, vae={"weights": None})
    log: dict = {
        "train_config": asdict(tc),
        "preset": cfg.name,
        "device": str(device),
        "torch": torch.__version__,
    }
    t0 = time.perf_counter()
    if tc.latents < (tc.window or cfg.stream.window_chunks):
        raise ValueError(
            f"clips of {tc.latents} latent frames after the reference are shorter than the "
            f"window ({tc.window or cfg.stream.window_chunks} chunks)"
        )
    st = cfg.vae.stride[0]
    n_frames = 1 + st * tc.latents
    frames, audio, seeds = make_dataset(
        tc.clips, n_frames, cfg.stream.height, cfg.stream.width, tc.seed, tc.workers
    )
    log["data"] = {
        "clips": tc.clips,
        "frames_per_clip": n_frames,
        "seconds": time.perf_counter() - t0,
        "seed_first": seeds[:3],
        "split": "train",
        "speech": "synthetic",
    }
    print(f"data: {tc.clips} clips x {n_frames} frames in {log['data']['seconds']:.1f}s", file=sys.stderr)
    if device.type == "cuda":  # CUDA only after the data processes have forked
        log["device_name"] = torch.cuda.get_device_name(device)
    frames_t = torch.from_numpy(frames).to(device)
    if tc.init:  # keep the previous run's autoencoder and its latent statistics
        from cadence.model.taehv import load_taehv
        from cadence.model.vae import WanVAE

        wan = WanVAE.from_diffusers_dir(Path(tc.init) / "vae", device, torch.float32)
        taehv = load_taehv(Path(tc.init) / "vae", device, torch.float32)
        prev = json.loads((Path(tc.init) / "train_log.json").read_text())
        log["vae"] = dict(prev.get("vae", {}), reused_from=str(tc.init))
        log["previous_dit"] = prev.get("dit")
        raw = encode_all(wan, frames_t, device)
        lat_mean, lat_std = wan.latents_mean.to(device), wan.latents_std.to(device)
    else:
        wan, taehv = train_vae(tc, cfg, frames_t, device, log)
        log["vae"].update(vae_eval(wan, taehv, frames_t, device))
        raw = encode_all(wan, frames_t, device)
        lat_mean = raw.mean(dim=(0, 2, 3, 4))
        lat_std = raw.std(dim=(0, 2, 3, 4)).clamp_min(1e-3)
    lat = (raw - lat_mean[None, :, None, None, None]) / lat_std[None, :, None, None, None]
    del frames_t, raw
    spf = AUDIO_SAMPLE_RATE // cfg.stream.fps
    audio_chunks = chunk_audio(torch.from_numpy(audio), tc.latents, spf).to(device)
    dit = train_dit(tc, cfg, lat, audio_chunks, device, log)
    log["total_seconds"] = time.perf_counter() - t0
    save(out, cfg, wan, taehv, dit, lat_mean.cpu(), lat_std.cpu(), log)
    print(
        f"wrote {out} in {log['total_seconds']:.0f}s: vae loss {log['vae']['loss_last_100']:.4f} "
        f"(psnr wan {log['vae']['psnr_wan_db']:.1f} dB, taehv {log['vae']['psnr_taehv_db']:.1f} dB), "
        f"dit loss {log['dit']['loss_last_100']:.4f}",
        file=sys.stderr,
    )
    return log


def toy_config() -> TrainConfig:
    """Seconds on a CPU: 64x64, a 2-layer 64-wide DiT, a handful of clips and steps (tests)."""
    return TrainConfig(
        overrides={
            "model": {"dim": 64, "num_heads": 2, "head_dim": 32, "ffn_dim": 128, "num_layers": 2},
            "vae": {"base_dim": 8, "taehv_channels": (16, 16)},
            "stream": {"height": 64, "width": 64},
        },
        clips=6,
        latents=5,
        vae_steps=6,
        vae_batch=2,
        vae_segment=1,
        dit_steps=8,
        dit_batch=4,
        vae_minutes=2.0,
        dit_minutes=2.0,
        workers=1,
        log_every=2,
    )


def main(argv: list[str] | None = None) -> int:
    from cadence.errors import (
        UsageParser,  # usage errors on one line, exit status 2, like every Cadence command
    )

    p = UsageParser(prog="cadence train", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", type=Path, required=True, help="output folder (weights, VAE folder, train_log.json)"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--minutes", type=float, default=None, help="total wall-time budget (splits VAE / DiT)")
    p.add_argument("--clips", type=int, default=None)
    p.add_argument("--toy", action="store_true", help="toy sizes (CPU, seconds): a smoke test, not a model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init", default=None, help="a previous run's folder: reuse its VAE, continue its DiT")
    p.add_argument(
        "--window", type=int, default=None, help="training window in chunks (default: the preset's)"
    )
    p.add_argument("--latents", type=int, default=None, help="latent frames per clip after the reference")
    p.add_argument("--dit-batch", type=int, default=None)
    p.add_argument("--dit-steps", type=int, default=None, help="DiT steps (the lr schedule's length)")
    p.add_argument("--dit-lr", type=float, default=None)
    a = p.parse_args(argv)
    if a.minutes is not None and a.minutes <= 0:
        p.error(f"--minutes must be positive, got {a.minutes}")
    tc = toy_config() if a.toy else TrainConfig()
    tc.seed = a.seed
    if a.clips:
        tc.clips = a.clips
    tc.init = a.init
    for k in ("window", "latents", "dit_batch", "dit_steps", "dit_lr"):
        if getattr(a, k) is not None:
            setattr(tc, k, getattr(a, k))
    train(tc, a.out, a.device, a.minutes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
