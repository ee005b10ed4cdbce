"""Self-Forcing's own streaming loop, timed (the families' side-by-side; run by hand or by the
plan families-ref of scripts/device_plans.toml; not part of Cadence).

    python scripts/reference_self_forcing_bench.py --ref /path/to/Self-Forcing --commit SHA \
        [--decoder wan|taehv|both] [--compile] [--repeats 2] [--out ref-{decoder}.json] [--small]

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

``--decoder taehv`` is the demo's other decoder (its "use TAEHV" switch, ``initialize_vae_decoder(
use_taehv=True)``): ``demo_utils.taehv.TAEHV`` (the taew2_1 layout: 256/128/64/64 wide, 3 MemBlocks a stage)
in fp16, random weights, called as the demo's ``TAEHVDiffusersWrapper.decode`` does: ``decode_video(latents,
parallel=False) * 2 - 1`` on the previous block's 3 latent frames + this block's (6 frames; the first block
alone), keeping frames 12.. (the first block: 3..); the demo never compiles it (its ``compile`` call skips the
decoder when TAEHV is on). ``--decoder both`` runs the Wan VAE videos, then the TAEHV ones, in one process
(the transformer compiled once, as the demo switching decoders would). The Cadence side of the same
comparison must decode with the same class: scripts/reference_taehv_weights.py writes this TAEHV's random
state dict in the published ``taew2_1.pth`` layout for ``--taehv-weights``.

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
the median time of blocks 2..7), the process's peak GPU memory (scripts/reference_common.py)."""

from __future__ import annotations

import contextlib
import io
import sys
import time
import types
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "fixtures")]  # reference_common; the fixtures' _reference
from _reference import (  # noqa: E402
    PromptStub,
    cuda_device_zero,
    import_self_forcing,
    open_checkout,
    sdpa_attention,
    wan_wrapper,
)
from reference_common import (  # noqa: E402
    Clock,
    base_parser,
    built,
    checkout_commit,
    report,
    run_repeats,
    stream_result,
    summary,
    sync,
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
        from demo_utils.taehv import TAEHV
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
        **vars(m),
        VAEDecoderWrapper=VAEDecoderWrapper,
        TAEHV=TAEHV,
        zero_cache=ZERO_VAE_CACHE,
        attention=attention,
    )


class TAEHVDecoder(torch.nn.Module):
    """The demo's ``TAEHVDiffusersWrapper`` (demo.py ``initialize_vae_decoder``), without its checkpoint
    download: ``demo_utils.taehv.TAEHV`` with random weights, ``decode`` = ``decode_video(latents,
    parallel=False) * 2 - 1``."""

    def __init__(self, TAEHV, dtype):
        super().__init__()
        self.taehv = TAEHV(checkpoint_path=None).to(dtype)

    def decode(self, latents):
        return self.taehv.decode_video(latents, parallel=False).mul_(2).sub_(1)


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
    decoders = {
        "wan": ref.VAEDecoderWrapper().eval().to(dev, dtype).requires_grad_(False),
        "taehv": TAEHVDecoder(ref.TAEHV, dtype).eval().to(dev).requires_grad_(False),
    }
    emb = torch.randn(1, geo["text_len"], geo["text_dim"], generator=torch.Generator().manual_seed(1))
    args = types.SimpleNamespace(
        denoising_step_list=STEPS,
        warp_denoising_step=True,
        num_frame_per_block=FRAMES_PER_BLOCK,
        independent_first_frame=False,
        context_noise=0,
    )
    pipe = ref.ci.CausalInferencePipeline(
        args, device=dev, generator=wrapper, text_encoder=PromptStub(emb), vae=decoders["wan"]
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
    return wrapper, decoders, pipe, emb.to(dev, dtype), (lh, lw), caches


class Decode:
    """One video's decoder state, as demo.py keeps it: the Wan VAE's causal cache (``vae_cache``), or for
    TAEHV the last block's latents (its ``vae_cache = denoised_pred[:, -3:]``)."""

    def __init__(self, kind: str, vae, caches, dev: str, dtype):
        self.kind, self.vae = kind, vae
        if kind == "wan":
            self.cache = [torch.zeros(1, c, 2, h, w, device=dev, dtype=dtype) for c, h, w in caches]
        else:
            self.cache = None

    def __call__(self, denoised, idx: int, dtype):
        if self.kind == "wan":
            with contextlib.redirect_stdout(io.StringIO()):  # the decoder prints its cache length every call
                pixels, cache = self.vae(denoised.to(dtype), *self.cache)
            self.cache = list(cache)
            return pixels[:, 3:] if idx == 0 else pixels
        if self.cache is None:
            self.cache = denoised
        else:
            denoised = torch.cat([self.cache, denoised], dim=1)
            self.cache = denoised[:, -3:]
        pixels = self.vae.decode(denoised)
        return pixels[:, 3:] if idx == 0 else pixels[:, 12:]


def denoise_block(wrapper, pipe, noisy, cond, start: int, dev: str):
    """demo.py's denoising loop for one block: every pass, x0 re-noised to the next timestep."""
    n = noisy.shape[1]
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
    return denoised, timestep


@torch.no_grad()
def run_video(wrapper, decode: Decode, pipe, emb, hw, dev: str, dtype, seed: int) -> dict:
    """One video, block by block, as demo.py's generate_video_stream."""
    lh, lw = hw
    cond = {"prompt_embeds": emb}
    rnd = torch.Generator(dev).manual_seed(seed)
    clock = Clock(dev)
    sync(dev)
    t_start = time.perf_counter()
    pipe._initialize_kv_cache(batch_size=1, dtype=dtype, device=dev)
    pipe._initialize_crossattn_cache(batch_size=1, dtype=dtype, device=dev)
    noise = torch.randn([1, BLOCKS * FRAMES_PER_BLOCK, 16, lh, lw], device=dev, dtype=dtype, generator=rnd)
    blocks, start, first_frames_s = [], 0, None
    for idx in range(BLOCKS):
        t0 = time.perf_counter()
        m0 = clock.mark()
        denoised, timestep = denoise_block(
            wrapper, pipe, noise[:, start : start + FRAMES_PER_BLOCK], cond, start, dev
        )
        m1 = clock.mark()
        if idx != BLOCKS - 1:  # the clean pass at t = 0 that writes the block into the cache
            wrapper(
                noisy_image_or_video=denoised,
                conditional_dict=cond,
                timestep=torch.zeros_like(timestep),
                kv_cache=pipe.kv_cache1,
                crossattn_cache=pipe.crossattn_cache,
                current_start=start * pipe.frame_seq_length,
            )
        m2 = clock.mark()
        pixels = decode(denoised, idx, dtype)
        m3 = clock.mark()
        host = pixels[0].cpu()
        t1 = time.perf_counter()
        if first_frames_s is None:
            first_frames_s = t1 - t_start
        blocks.append(
            dict(
                block=idx,
                frames=int(host.shape[0]),
                wall_ms=(t1 - t0) * 1e3,
                denoise_ms=clock.ms(m0, m1),
                cache_pass_ms=clock.ms(m1, m2),
                decode_ms=clock.ms(m2, m3),
                finite=bool(torch.isfinite(host).all()),
            )
        )
        start += FRAMES_PER_BLOCK
    return stream_result(blocks, time.perf_counter() - t_start, first_frames_s, FRAMES_PER_BLOCK * 4)


def main() -> None:
    ap = base_parser(__doc__, "checkout of guandeh17/Self-Forcing")
    ap.add_argument(
        "--decoder",
        default="wan",
        choices=["wan", "taehv", "both"],
        help="the demo's decoder: the streaming Wan VAE (its default), TAEHV (its switch), or both in turn",
    )
    ap.add_argument(
        "--compile", action="store_true", help="the demo's torch.compile (max-autotune-no-cudagraphs)"
    )
    ap.add_argument(
        "--compile-mode",
        default="max-autotune-no-cudagraphs",
        help="torch.compile mode with --compile (the demo's: max-autotune-no-cudagraphs; its autotuning of "
        "every conv and matmul shape takes over 400 s on an H200, so 'default' is the affordable one)",
    )
    a = ap.parse_args()
    if a.out and a.decoder == "both" and "{decoder}" not in str(a.out):
        ap.error("--decoder both writes two files: put {decoder} in --out")
    ref_dir = a.ref.resolve()
    commit = checkout_commit(ref_dir, a.commit, open_checkout(ref_dir))
    ref = import_reference(ref_dir)
    dtype = torch.float16 if a.device.startswith("cuda") else torch.float32
    t = time.perf_counter()
    wrapper, decoders, pipe, emb, hw, caches = build(ref, a.device, dtype, a.small)
    build_s = time.perf_counter() - t
    built(a.device)
    mode = None if a.compile_mode == "default" else a.compile_mode
    if a.compile:  # the demo compiles the transformer, and the decoder unless it is TAEHV
        wrapper.compile(mode=mode)
        decoders["wan"].compile(mode=mode)
    for kind in ("wan", "taehv") if a.decoder == "both" else (a.decoder,):
        runs, first_run_s = run_repeats(
            lambda r, kind=kind: run_video(
                wrapper,
                Decode(kind, decoders[kind], caches, a.device, dtype),
                pipe,
                emb,
                hw,
                a.device,
                dtype,
                r,
            ),
            a.repeats,
        )
        meta = dict(
            reference="guandeh17/Self-Forcing",
            reference_commit=commit,
            harness="scripts/reference_self_forcing_bench.py (demo.py's block loop)",
            dtype=str(dtype).removeprefix("torch."),
            compile=a.compile_mode if a.compile else None,
            attention=ref.attention,
            decoder={
                "wan": "demo_utils.vae_block3.VAEDecoderWrapper (Wan 2.1, streaming)",
                "taehv": "demo_utils.taehv.TAEHV (taew2_1 layout), eager",
            }[kind],
            geometry=dict(latent=list(hw), blocks=BLOCKS, frames_per_block=FRAMES_PER_BLOCK, steps=STEPS),
            small=a.small,
            build_s=build_s,
            fps_steady_rule="12 frames / median wall time of blocks 2..7",
        )
        s = summary(meta, runs, first_run_s, a.device, ("denoise", "cache_pass", "decode"))
        out = Path(str(a.out).replace("{decoder}", kind)) if a.out else None
        report(s, f"{'compiled' if a.compile else 'eager'} ({kind})", out)


if __name__ == "__main__":
    main()
