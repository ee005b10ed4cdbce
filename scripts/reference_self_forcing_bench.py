"""Self-Forcing's own streaming loop, timed (issue 15's side-by-side; run by hand or by
scripts/device_sf_side_by_side.sh, not part of Cadence).

    python scripts/reference_self_forcing_bench.py --ref /path/to/Self-Forcing --commit SHA \
        [--compile] [--repeats 2] [--out ref.json] [--small]

``--ref`` is a checkout of guandeh17/Self-Forcing (imported from there, never copied). The script builds
the reference's own modules, with random weights, at the family's geometry (Wan2.1-T2V-1.3B, 480x832,
21 latent frames = 7 blocks of 3, the warped 1000/750/500/250 schedule, shift 5): its ``CausalWanModel``
in its ``WanDiffusionWrapper`` (assembled by hand: its ``__init__`` loads ``wan_models/`` from disk), its
``CausalInferencePipeline`` (K/V and cross-attention caches, schedule, scheduler), and its streaming
full-VAE decoder ``demo_utils.vae_block3.VAEDecoderWrapper`` (the Wan 2.1 decoder with its per-frame causal
cache). It then runs the block loop of the reference's real-time demo (``demo.py``'s
``generate_video_stream``: per block the denoising passes with re-noising, the clean pass at timestep 0
that writes the cache, the VAE decode of the block, the first block's first 3 frames dropped, the frames
copied to the host) in fp16 as the demo does, ``--compile`` applying the demo's
``module.compile(mode="max-autotune-no-cudagraphs")`` to the transformer and the decoder. The loop is the
demo's, re-typed here as a harness (the demo file itself starts a Flask server at import).

What differs from the demo, all outside its math: random weights; the prompt embedding is a fixed random
[1, 512, 4096] tensor (the umT5 encoder runs once per prompt, outside the block loop); frames are copied to
the host in one ``.cpu()`` per block (the demo copies frame by frame); nothing is JPEG-encoded or sent.
Attention: the reference calls flash-attn 2/3 when installed; without it (the lent GPU machine has none)
its cross-attention refuses to run and its SDPA fallback returns bf16 into the fp16 linears, so both are
replaced by torch SDPA in the inputs' dtype (``_reference.sdpa_attention``; on an H200 SDPA runs
FlashAttention-2 or cuDNN kernels). Which one ran is recorded (``attention``).

Timing: ``--repeats`` whole 7-block videos; the first absorbs compilation (reported as ``first_run_s``),
the others are timed: per block wall time (block start -> its frames on the host), CUDA-event split
(denoise / cache pass / decode), time to first frames (loop start -> block 1's frames on the host, as the
demo's ``generation_start_time``), fps over the whole video (frames / wall time) and steady fps (12 frames /
the median time of blocks 2..7)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "fixtures"))
from _reference import (  # noqa: E402
    PromptStub,
    cuda_device_zero,
    import_self_forcing,
    open_checkout,
    sdpa_attention,
    wan_wrapper,
)

WAN13 = dict(dim=1536, num_heads=12, ffn_dim=8960, num_layers=30, freq_dim=256, text_dim=4096, text_len=512)
STEPS = [1000, 750, 500, 250]
FRAMES_PER_BLOCK = 3
BLOCKS = 7


def import_reference(ref: Path):
    m = import_self_forcing(ref)
    with cuda_device_zero():
        import wan.modules.attention as wattn
        from demo_utils.constant import ZERO_VAE_CACHE
        from demo_utils.vae_block3 import VAEDecoderWrapper
    if wattn.FLASH_ATTN_3_AVAILABLE:
        attention = "flash-attn 3"
    elif wattn.FLASH_ATTN_2_AVAILABLE:
        attention = "flash-attn 2"
    else:
        # without flash-attn the reference's cross-attention asserts and its SDPA fallback returns bf16 into
        # fp16 linears: torch SDPA in the inputs' dtype, as flash-attn would be called
        m.wm.flash_attention = sdpa_attention
        m.cm.attention = sdpa_attention
        attention = "torch SDPA in the inputs' dtype (flash-attn not installed)"
    return types.SimpleNamespace(
        **vars(m), VAEDecoderWrapper=VAEDecoderWrapper, zero_cache=ZERO_VAE_CACHE, attention=attention
    )


def build(ref, dev: str, dtype, small: bool):
    geo = dict(WAN13)
    if small:  # CPU smoke test of this harness: one layer, a small frame (the pipeline's sizes patched)
        geo["num_layers"] = 1
    with torch.device(dev):
        torch.manual_seed(0)
        model = ref.CausalWanModel(
            model_type="t2v",
            patch_size=(1, 2, 2),
            in_dim=16,
            out_dim=16,
            local_attn_size=-1,
            sink_size=0,
            **geo,
        ).eval()
    wrapper = wan_wrapper(ref.ww, model, ref.FlowMatchScheduler, 5.0).to(dev, dtype).requires_grad_(False)
    vae = ref.VAEDecoderWrapper().eval().to(dev, dtype).requires_grad_(False)
    emb = torch.randn(1, geo["text_len"], geo["text_dim"], generator=torch.Generator().manual_seed(1))
    args = types.SimpleNamespace(
        denoising_step_list=STEPS,
        warp_denoising_step=True,
        num_frame_per_block=FRAMES_PER_BLOCK,
        independent_first_frame=False,
        context_noise=0,
    )
    pipe = ref.ci.CausalInferencePipeline(
        args, device=dev, generator=wrapper, text_encoder=PromptStub(emb), vae=vae
    )
    lh, lw = (60, 104)
    if small:
        lh, lw = (8, 16)
        pipe.num_transformer_blocks = geo["num_layers"]
        pipe.frame_seq_length = (lh // 2) * (lw // 2)
        for blk in model.blocks:
            blk.self_attn.max_attention_size = BLOCKS * FRAMES_PER_BLOCK * pipe.frame_seq_length
    # the decoder's causal cache at this frame size (the demo's ZERO_VAE_CACHE is for 60 x 104 latents)
    caches = [(c.shape[1], c.shape[3] * lh // 60, c.shape[4] * lw // 104) for c in ref.zero_cache]
    return wrapper, vae, pipe, emb.to(dev, dtype), (lh, lw), caches


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize(dev)


class _Events:
    """CUDA events (or host clocks on the CPU) at the phase boundaries of a block, read after its sync."""

    def __init__(self, dev: str):
        self.cuda = dev.startswith("cuda")
        self.marks: list = []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        m = self.marks
        if self.cuda:
            return [m[i].elapsed_time(m[i + 1]) for i in range(len(m) - 1)]
        return [(m[i + 1] - m[i]) * 1e3 for i in range(len(m) - 1)]


@torch.no_grad()
def run_video(wrapper, vae, pipe, emb, hw, caches, dev: str, dtype, seed: int) -> dict:
    """One video, block by block, as demo.py's generate_video_stream (full-VAE branch)."""
    lh, lw = hw
    cond = {"prompt_embeds": emb}
    rnd = torch.Generator(dev).manual_seed(seed)
    sync(dev)
    t_start = time.perf_counter()
    pipe._initialize_kv_cache(batch_size=1, dtype=dtype, device=dev)
    pipe._initialize_crossattn_cache(batch_size=1, dtype=dtype, device=dev)
    noise = torch.randn([1, BLOCKS * FRAMES_PER_BLOCK, 16, lh, lw], device=dev, dtype=dtype, generator=rnd)
    vae_cache = [torch.zeros(1, c, 2, h, w, device=dev, dtype=dtype) for c, h, w in caches]
    blocks = []
    start = 0
    first_frames_s = None
    frames = 0
    for idx in range(BLOCKS):
        n = FRAMES_PER_BLOCK
        t0 = time.perf_counter()
        ev = _Events(dev)
        ev.mark()
        noisy = noise[:, start : start + n]
        for i, t in enumerate(pipe.denoising_step_list):
            timestep = torch.ones([1, n], device=dev, dtype=torch.int64) * t
            _, denoised = wrapper(
                noisy_image_or_video=noisy,
                conditional_dict=cond,
                timestep=timestep,
                kv_cache=pipe.kv_cache1,
                crossattn_cache=pipe.crossattn_cache,
                current_start=start * pipe.frame_seq_length,
            )
            if i < len(pipe.denoising_step_list) - 1:
                nxt = pipe.denoising_step_list[i + 1]
                noisy = pipe.scheduler.add_noise(
                    denoised.flatten(0, 1),
                    torch.randn_like(denoised.flatten(0, 1)),
                    nxt * torch.ones([n], device=dev, dtype=torch.long),
                ).unflatten(0, denoised.shape[:2])
        ev.mark()
        if idx != BLOCKS - 1:
            wrapper(
                noisy_image_or_video=denoised,
                conditional_dict=cond,
                timestep=torch.zeros_like(timestep),
                kv_cache=pipe.kv_cache1,
                crossattn_cache=pipe.crossattn_cache,
                current_start=start * pipe.frame_seq_length,
            )
        ev.mark()
        with contextlib.redirect_stdout(io.StringIO()):  # the decoder prints its cache length every call
            pixels, vae_cache = vae(denoised.to(dtype), *vae_cache)
        vae_cache = list(vae_cache)
        if idx == 0:
            pixels = pixels[:, 3:]
        ev.mark()
        host = pixels[0].cpu()
        t1 = time.perf_counter()
        if first_frames_s is None:
            first_frames_s = t1 - t_start
        frames += host.shape[0]
        d, c, v = ev.spans()
        blocks.append(
            dict(
                block=idx,
                frames=int(host.shape[0]),
                wall_ms=(t1 - t0) * 1e3,
                denoise_ms=d,
                cache_pass_ms=c,
                decode_ms=v,
                finite=bool(torch.isfinite(host).all()),
            )
        )
        start += n
    total = time.perf_counter() - t_start
    steady = [b["wall_ms"] for b in blocks[1:]]
    return dict(
        blocks=blocks,
        frames=frames,
        total_s=total,
        ttff_ms=first_frames_s * 1e3,
        fps_video=frames / total,
        block_ms_median_2_7=statistics.median(steady),
        fps_steady=FRAMES_PER_BLOCK * 4 / (statistics.median(steady) / 1e3),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True, type=Path, help="checkout of guandeh17/Self-Forcing")
    ap.add_argument("--commit", default="", help="the checkout's commit (when it is not a git checkout)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument(
        "--compile", action="store_true", help="the demo's torch.compile (max-autotune-no-cudagraphs)"
    )
    ap.add_argument(
        "--compile-mode",
        default="max-autotune-no-cudagraphs",
        help="torch.compile mode with --compile (the demo's: max-autotune-no-cudagraphs; its autotuning of "
        "every conv and matmul shape takes over 400 s on an H200, so 'default' is the affordable one)",
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--small", action="store_true", help="CPU smoke test: one layer, 8x16 latents")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    ref_dir = a.ref.resolve()
    commit = open_checkout(ref_dir) or a.commit
    ref = import_reference(ref_dir)
    dtype = torch.float16 if a.device.startswith("cuda") else torch.float32
    t = time.perf_counter()
    wrapper, vae, pipe, emb, hw, caches = build(ref, a.device, dtype, a.small)
    build_s = time.perf_counter() - t
    if a.compile:
        mode = None if a.compile_mode == "default" else a.compile_mode
        wrapper.compile(mode=mode)
        vae.compile(mode=mode)
    runs = []
    first_run_s = None
    for r in range(a.repeats):
        t = time.perf_counter()
        res = run_video(wrapper, vae, pipe, emb, hw, caches, a.device, dtype, seed=r)
        if r == 0:
            first_run_s = time.perf_counter() - t
        runs.append(res)
        print(
            f"run {r}: {res['frames']} frames in {res['total_s']:.2f} s = {res['fps_video']:.1f} fps; steady "
            f"{res['fps_steady']:.1f} fps (block {res['block_ms_median_2_7']:.1f} ms); ttff {res['ttff_ms']:.0f} ms",
            flush=True,
        )
    timed = runs[1:] or runs
    best = min(timed, key=lambda x: x["total_s"])
    b = best["blocks"]
    summary = dict(
        reference="guandeh17/Self-Forcing",
        reference_commit=commit,
        harness="scripts/reference_self_forcing_bench.py (demo.py's block loop)",
        device=torch.cuda.get_device_name(a.device) if a.device.startswith("cuda") else "cpu",
        torch=torch.__version__,
        dtype=str(dtype).removeprefix("torch."),
        compile=a.compile_mode if a.compile else None,
        attention=ref.attention,
        geometry=dict(latent=list(hw), blocks=BLOCKS, frames_per_block=FRAMES_PER_BLOCK, steps=STEPS),
        small=a.small,
        build_s=build_s,
        first_run_s=first_run_s,
        fps_video=best["fps_video"],
        fps_steady=best["fps_steady"],
        ttff_ms=best["ttff_ms"],
        block_ms=[x["wall_ms"] for x in b],
        denoise_ms=[x["denoise_ms"] for x in b],
        cache_pass_ms=[x["cache_pass_ms"] for x in b],
        decode_ms=[x["decode_ms"] for x in b],
        finite=all(x["finite"] for x in b),
        runs=runs,
    )
    print(
        f"reference {'compiled' if a.compile else 'eager'}: fps {summary['fps_video']:.1f} (video) / "
        f"{summary['fps_steady']:.1f} (steady), ttff {summary['ttff_ms']:.0f} ms, blocks "
        + " ".join(f"{x:.0f}" for x in summary["block_ms"])
        + f" ms; decode {statistics.median(summary['decode_ms']):.1f} ms; attention {ref.attention}",
        flush=True,
    )
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
