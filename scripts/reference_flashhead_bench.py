"""SoulX-FlashHead's own streaming loop on one GPU, Pro or Lite, timed (the families' side-by-side; not part of
Cadence).

    python scripts/reference_flashhead_bench.py --ref .ref/SoulX-FlashHead --variant pro|lite [--eager] \
        [--clips 10] [--warmup-clips 2] [--repeats 2] [--out ref.json] [--small]

``--ref`` is a checkout of Soul-AILab/SoulX-FlashHead (imported from there, never copied; made by
scripts/reference_checkouts.sh). The script runs what its streaming app runs per chunk
(``gradio_app_streaming.py``, ``run_inference_streaming``'s ``inference_worker``), re-typed because that
function is a Gradio generator whose other thread writes mp4 segments with ffmpeg: an 8 s ``deque`` of 16 kHz
audio (``cached_audio_duration``) extended by one chunk's new audio, ``flash_head.inference.
get_audio_embedding`` over the whole window (their wav2vec2 subclass at wav2vec2-base-960h's geometry, the
5-frame window around each of the last 33 video frames), ``flash_head.inference.run_pipeline``
(``FlashHeadPipeline.generate``: 4 passes of their ``WanModelAudioProject`` over the 33-frame clip, the motion
latents pinned, the clip decoded, colour-matched to the reference image, the last 5 (Pro) / 9 (Lite) frames
encoded into the next clip's motion latents), the motion frames cut (``video[motion_frames_num:]``: 28 new
frames for Pro, 24 for Lite) and the frames copied to the host as numpy, as the worker hands them to its
queue. Before the loop, ``flash_head.inference.get_base_data`` (``prepare_params``: the reference image
encoded over 33 frames), untimed by the loop and reported as ``prepare_ms``. Their ``get_pipeline`` runs
(``FlashHeadPipeline`` and ``get_device`` replaced) so ``motion_frames_num`` and ``sample_steps`` come from it;
``infer_params`` (``flash_head/configs/infer_params.yaml``): 512x512, 33 frames, 2 motion latents, 4 steps
shifted by 5, 25 fps, colour correction 1.0.

The pipeline is built as ``FlashHeadPipeline.__init__`` leaves it (that constructor loads the model, the VAE
and wav2vec2 from disk), bf16 (its ``param_dtype``; wav2vec2 float32 as its ``.to(device)`` leaves it) and
compiled as it ships (``COMPILE_MODEL`` / ``COMPILE_VAE``, both True in ``flash_head_pipeline.py``:
``torch.compile`` of the model, and of ``WanVAE.encode`` / ``decode`` (Pro) or the LTX
``CausalVideoAutoencoder.encode`` / ``decode`` (Lite)); ``--eager`` leaves them eager. Random weights at the
released sizes, made on the device: their ``WanModelAudioProject`` at Cadence's ``released_config`` (Wan2.1-
1.3B: 1536 wide, 30 layers, 12 heads, ffn 8960; Pro in 32 / out 16 channels, patch 1x2x2, VAE stride 4x8x8;
Lite in 256 / out 128, patch 1x1x1, stride 8x32x32; the audio projection as their ``__init__`` hard-codes it:
5 x 12 x 768 -> 512 -> 32 x 1536), every parameter + N(0, 0.05^2); Pro's decoder their ``WanVAE`` around
their ``WanVAE_`` (dim 96, z 16; PyTorch's init, what ``_video_vae`` builds before loading the .pth), Lite's
their ``LtxVAE`` around their vendored ``CausalVideoAutoencoder`` at the LTX-Video 0.9.0 config (their
``diffusers_config_mapping`` entry for the released ``VAE_LTX/config.json``; PyTorch's init, random
per-channel statistics loaded through their ``load_state_dict``); wav2vec2 their ``Wav2Vec2Model`` subclass
at ``Wav2Vec2Config()``'s defaults (wav2vec2-base: 7 conv layers of 512, 12 x 768), transformers' init.

Shims, outside their math (recorded in the JSON): scripts/fixtures/make_flashhead.py's ``import_reference``
(xfuser, pyloudnorm, mediapipe, imageio and librosa stubbed: sequence parallelism, a commented-out call, the
face crop (off), file I/O; torchvision's Python transforms imported without its C++ op registrations); no
flash-attn or SageAttention on the machine, so their ``flash_attention`` takes its own torch SDPA branch in
bf16; under transformers >= 5 the hidden states their 4.x-era wav2vec2 subclass no longer gets are handed
back by forward hooks (scripts/reference_flashtalk_bench.py's ``hidden_states_shim``: the features equal
transformers 4.57.3's bit for bit on the parity fixture, tests/test_reference_flashhead.py); the audio is a
synthetic voiced signal (make_flashhead's ``synthetic_speech``), the reference image random pixels.
``--small`` (CPU, float32): the parity fixture's tiny model (make_flashhead's ``VARIANTS`` / ``tiny_model``)
and wav2vec2 (``W2V_TINY``), a 4-wide Wan VAE (Pro) or a tiny LTX VAE of the released structure with 32x
spatial compression and 8 latent channels (Lite), frames of 32 (Pro) / 64 (Lite) pixels.

Timing (scripts/reference_common.py): per chunk the host wall time (audio window -> new frames on the host:
``wall_ms``), ``run_pipeline_ms`` (CUDA events around ``run_pipeline`` and the cut, after the sync their worker
makes), the audio embedding (``audio_ms``), the model passes, the decode, the motion encode and the host copy;
``ttff_ms`` from the loop's start to the first chunk's frames on the host (``ttff_with_prepare_ms`` adds
``prepare_params``); ``fps_steady`` = new frames / the median wall time of chunks 2..; ``fps_run_pipeline``
the same over ``run_pipeline_ms``. The first of ``--repeats`` runs (``--warmup-clips`` chunks) absorbs
compilation (``first_run_s``; ``compile_s_warmup`` / ``compile_s_total``: torch.compile's own phase times after
the warm-up and at the end, equal when the timed run compiled nothing)."""

from __future__ import annotations

import copy
import statistics
import sys
import tempfile
import time
import types
from collections import deque
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "fixtures"), str(HERE.parent)]
import make_flashhead as mf  # noqa: E402
from reference_common import (  # noqa: E402
    Clock,
    Spans,
    base_parser,
    built,
    checkout_commit,
    perturb_,
    random_wan_vae,
    report,
    run_repeats,
    stream_result,
    summary,
    sync,
)

from cadence.model.flashhead import released_config  # noqa: E402

TEXT_DIM = 4096  # Wan2.1's umT5 width: their unused ``text_embedding`` is in the released file
#: --small, Lite: a tiny LTX VAE of the released block structure (make_ltx_vae.py's TINY_OURS) with the
#: released 32x spatial / 8x temporal compression (patch 4 + three compress_all) and the tiny DiT's 8 channels.
LTX_TINY_CHANNELS, LTX_TINY_PATCH = mf.VARIANTS["lite"]["out_dim"], 4


def import_reference(ref: Path, dev: str) -> types.SimpleNamespace:
    """Their modules through make_flashhead's importer (its stubs), CUDA's synchronize restored on a GPU (the
    importer makes it a no-op for the CPU) and their LTX-Video VAE modules."""
    real_sync = torch.cuda.synchronize
    ns = mf.import_reference(ref)
    shims = [
        "scripts/fixtures/make_flashhead.py import_reference: xfuser / pyloudnorm / mediapipe / imageio / "
        "librosa stubbed; torchvision's transforms without its C++ op registrations",
    ]
    if str(dev).startswith("cuda"):
        torch.cuda.synchronize = real_sync
    else:
        shims.append("torch.cuda.synchronize a no-op (CPU)")
    import flash_head.ltx_video.ltx_vae as ltx
    import flash_head.ltx_video.models.autoencoders.causal_video_autoencoder as cva
    import flash_head.ltx_video.utils.diffusers_config_mapping as dcm

    ns.ltx, ns.cva, ns.dcm, ns.shims = ltx, cva, dcm, shims
    ns.attention = "their flash_attention's torch SDPA branch (no flash-attn / SageAttention installed)"
    return ns


def their_config(variant: str, small: bool) -> dict:
    """``WanModelAudioProject``'s config.json fields: the fixture's tiny sizes, or Cadence's released geometry."""
    if small:
        return dict(mf.VARIANTS[variant])
    c = released_config(variant)
    return dict(
        dim=c.dim,
        in_dim=c.in_dim,
        ffn_dim=c.ffn_dim,
        out_dim=c.out_dim,
        text_dim=TEXT_DIM,
        freq_dim=c.freq_dim,
        eps=c.eps,
        vae_stride=list(c.vae_stride),
        patch_size=list(c.patch),
        num_heads=c.num_heads,
        num_layers=c.num_layers,
        has_image_input=False,
    )


def build_model(ref, cfg: dict, dev: str, dtype, small: bool):
    """Their DiT with random weights (+ N(0, 0.05^2)), made on the device, in the pipeline's dtype."""
    if small:
        return mf.tiny_model(ref.fm, cfg).requires_grad_(False)
    with torch.device(dev):  # float32, then cast as from_pretrained + .to(dtype) leaves it
        torch.manual_seed(0)
        model = ref.fm.WanModelAudioProject(**cfg)
        perturb_(model)
    return model.to(dtype).eval().requires_grad_(False)


def build_wan_vae(ref, dev: str, dtype, small: bool):
    """Their ``WanVAE`` (Pro) around a random ``WanVAE_`` (dim 96; the fixture's 4 under --small)."""
    dim = mf.VAE_TINY["dim"] if small else 96
    real = ref.vae_mod._video_vae
    ref.vae_mod._video_vae = lambda **kw: random_wan_vae(ref.vae_mod.WanVAE_, dim)  # no .pth to read
    try:
        return ref.vae_mod.WanVAE(vae_path="(random)", dtype=dtype, device=dev, parallel=False)
    finally:
        ref.vae_mod._video_vae = real


def ltx_block_config(ref, small: bool) -> dict:
    """Their ``CausalVideoAutoencoder`` config: the entry their table maps the released ``VAE_LTX/config.json``
    (LTX-Video 0.9.0) to, checked equal to Cadence's ``RELEASED_CONFIG``; under --small a tiny one."""
    if small:
        import make_ltx_vae

        return dict(
            copy.deepcopy(make_ltx_vae.TINY_OURS),
            latent_channels=LTX_TINY_CHANNELS,
            patch_size=LTX_TINY_PATCH,
        )
    from cadence.model.ltx_vae import RELEASED_CONFIG

    if ref.dcm.DIFFUSERS_VAE_CONFIG != RELEASED_CONFIG:
        raise SystemExit("error: their LTX VAE config is not the one Cadence's ltx_vae calls released")
    key = ref.dcm.make_hashable_key(ref.dcm.DIFFUSERS_VAE_CONFIG)
    return copy.deepcopy(ref.dcm.diffusers_and_ours_config_mapping[key])


def build_ltx_vae(ref, dev: str, dtype, small: bool):
    """Their ``LtxVAE`` (Lite) around a random ``CausalVideoAutoencoder``: ``from_config`` as their
    ``from_pretrained`` calls it, then the per-channel statistics through their ``load_state_dict`` (mean
    N(0, 0.5^2), std U(0.5, 1.5)), moved and cast as ``LtxVAE.__init__`` does."""
    torch.manual_seed(1)
    model = ref.cva.CausalVideoAutoencoder.from_config(ltx_block_config(ref, small))
    c = model.decoder.conv_in.in_channels
    stats = {
        "per_channel_statistics.mean-of-means": torch.randn(c) * 0.5,
        "per_channel_statistics.std-of-means": torch.rand(c) + 0.5,
    }
    model.load_state_dict({**model.state_dict(), **stats})
    vae = ref.ltx.LtxVAE.__new__(ref.ltx.LtxVAE)
    vae.model = model.eval().requires_grad_(False).to(dev).to(dtype)
    return vae


def build_audio(ref, dev: str, small: bool):
    """Their wav2vec2 subclass (wav2vec2-base sizes; the fixture's tiny ones under --small) and the default
    feature extractor (base-960h's preprocessor: 16 kHz, normalised, no attention mask)."""
    from reference_flashtalk_bench import hidden_states_shim
    from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor

    torch.manual_seed(2)
    audio = ref.fw.Wav2Vec2Model(Wav2Vec2Config(**(mf.W2V_TINY if small else {}))).to(dev).eval()
    audio.feature_extractor._freeze_parameters()
    hidden_states_shim(audio, ref.shims)
    return audio, Wav2Vec2FeatureExtractor()


def build_pipeline(ref, variant: str, dev: str, dtype, small: bool, compile_: bool, eager_vae: bool = False):
    """``FlashHeadPipeline`` as its ``__init__`` leaves it (compiled as it ships unless ``--eager``), then their
    ``get_pipeline`` around it (motion frames and steps into ``infer_params``)."""
    cfg = their_config(variant, small)
    model = build_model(ref, cfg, dev, dtype, small)
    vae = (
        build_ltx_vae(ref, dev, dtype, small) if variant == "lite" else build_wan_vae(ref, dev, dtype, small)
    )
    p = ref.fp.FlashHeadPipeline.__new__(ref.fp.FlashHeadPipeline)
    p.param_dtype, p.device, p.rank, p.use_usp = dtype, dev, 0, False
    p.model_type, p.use_ltx = variant, variant == "lite"
    p.vae, p.model, p.config, p.sp_size = vae, model, model.config, 1
    p.num_timesteps, p.use_timestep_transform = 1000, True
    if compile_ and ref.fp.COMPILE_MODEL:
        p.model = torch.compile(p.model)
    if compile_ and ref.fp.COMPILE_VAE and not eager_vae:
        target = p.vae.model if p.use_ltx else p.vae
        target.encode = torch.compile(target.encode)
        target.decode = torch.compile(target.decode)
    p.audio_encoder, p.wav2vec_feature_extractor = build_audio(ref, dev, small)
    ref.inf.FlashHeadPipeline = lambda **kw: p
    ref.inf.get_device = lambda *a: dev
    if small:
        ref.inf.infer_params["height"] = ref.inf.infer_params["width"] = mf.SIZE[variant]
    got = ref.inf.get_pipeline(world_size=1, ckpt_dir="(random)", model_type=variant, wav2vec_dir="(random)")
    assert got is p
    return p, cfg


def instrument(p, spans: Spans) -> None:
    p.model = spans.wrap("denoise", p.model)
    p.vae.decode = spans.wrap("decode", p.vae.decode)
    p.vae.encode = spans.wrap("encode", p.vae.encode)


def speech_slices(clips: int, slice_samples: int, seed: int) -> np.ndarray:
    """``clips`` chunks of synthetic speech as their app slices a 16 kHz file (float32 in [-1, 1])."""
    g = torch.Generator().manual_seed(seed)
    pcm = mf.synthetic_speech(clips * slice_samples, g)
    return (pcm.astype(np.float32) / 32768).reshape(clips, slice_samples)


def chunk_record(spans: Spans, i: int, frames: np.ndarray, marks: tuple, t0: float, t1: float, t_start):
    a, b, c, d = marks
    sp = spans.read()
    return dict(
        block=i,
        frames=int(frames.shape[0]),
        wall_ms=(t1 - t0) * 1e3,
        audio_ms=spans.clock.ms(a, b),
        run_pipeline_ms=spans.clock.ms(b, c),
        host_ms=spans.clock.ms(c, d),
        denoise_ms=sum(x["ms"] for x in sp if x["name"] == "denoise"),
        decode_ms=sum(x["ms"] for x in sp if x["name"] == "decode"),
        encode_ms=sum(x["ms"] for x in sp if x["name"] == "encode"),
        passes=sum(x["name"] == "denoise" for x in sp),
        from_start_ms=(t1 - t_start) * 1e3,
        finite=bool(np.isfinite(frames).all()),
    )


@torch.no_grad()
def run_stream(ref, p, spans: Spans, clips: int, image: Path, dev: str) -> dict:
    """get_base_data, then ``inference_worker``'s loop for ``clips`` chunks."""
    ip = ref.inf.get_infer_params()
    sr, fps, cached = ip["sample_rate"], ip["tgt_fps"], ip["cached_audio_duration"]
    frame_num, motion = ip["frame_num"], ip["motion_frames_num"]
    slice_len = frame_num - motion
    sync(dev)
    t = time.perf_counter()
    ref.inf.get_base_data(p, cond_image_path_or_dir=str(image), base_seed=9999, use_face_crop=False)
    sync(dev)
    prepare_ms = (time.perf_counter() - t) * 1e3
    print(f"prepare_params {prepare_ms:.0f} ms", flush=True)
    cached_sum = sr * cached
    audio_end = cached * fps
    audio_start = audio_end - frame_num
    slices = speech_slices(clips, slice_len * sr // fps, seed=1)
    dq = deque([0.0] * cached_sum, maxlen=cached_sum)
    clock, out, first = spans.clock, [], None
    t_start = time.perf_counter()
    for i, piece in enumerate(slices):
        spans.clear()
        t0 = time.perf_counter()
        a = clock.mark()
        dq.extend(piece.tolist())
        emb = ref.inf.get_audio_embedding(p, np.array(dq), audio_start, audio_end)
        sync(dev)  # their worker: torch.cuda.synchronize() before timing run_pipeline
        b = clock.mark()
        video = ref.inf.run_pipeline(p, emb)
        video = video[motion:]
        c = clock.mark()
        sync(dev)
        frames = video.cpu().numpy()
        d = clock.mark()
        t1 = time.perf_counter()
        first = first if first is not None else t1 - t_start
        sync(dev)
        out.append(chunk_record(spans, i, frames, (a, b, c, d), t0, t1, t_start))
        x = out[-1]
        print(
            f"chunk {i}: {x['wall_ms']:.0f} ms (audio {x['audio_ms']:.0f}, passes {x['denoise_ms']:.0f}, decode "
            f"{x['decode_ms']:.0f}, encode {x['encode_ms']:.0f}, host {x['host_ms']:.0f})",
            flush=True,
        )
    res = stream_result(out, time.perf_counter() - t_start, first, slice_len, prepare_ms=prepare_ms)
    res["ttff_with_prepare_ms"] = res["ttff_ms"] + prepare_ms
    steady = [x["run_pipeline_ms"] for x in out[1:]] or [out[0]["run_pipeline_ms"]]
    res["fps_run_pipeline"] = slice_len / (statistics.median(steady) / 1e3)
    return res


def random_image(folder: Path, side: int) -> Path:
    from PIL import Image

    rng = np.random.default_rng(0)
    path = folder / "reference.png"
    Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(path)
    return path


def meta(ref, a, cfg: dict, commit: str, dtype, build_s: float) -> dict:
    ip = ref.inf.get_infer_params()
    pro = a.variant == "pro"
    return dict(
        reference="Soul-AILab/SoulX-FlashHead",
        reference_commit=commit,
        harness="scripts/reference_flashhead_bench.py (gradio_app_streaming.py inference_worker: 8 s audio "
        "deque, get_audio_embedding + run_pipeline per chunk, motion frames cut)",
        variant=a.variant,
        dtype=str(dtype).removeprefix("torch."),
        compile=None
        if a.eager
        else (
            "COMPILE_MODEL only (torch.compile default; their VAE eager: --eager-vae)"
            if a.eager_vae
            else "COMPILE_MODEL / COMPILE_VAE (torch.compile default, as shipped)"
        ),
        attention=ref.attention,
        decoder=(
            "flash_head WanVAE.decode (Wan 2.1, whole 33-frame clip) + 5-frame motion encode"
            if pro
            else "flash_head LtxVAE (CausalVideoAutoencoder, LTX-Video 0.9.0 config) decode of the clip "
            "+ 9-frame motion encode"
        ),
        geometry=dict(
            frame=[ip["height"], ip["width"]],
            frame_num=ip["frame_num"],
            motion_frames=ip["motion_frames_num"],
            new_frames=ip["frame_num"] - ip["motion_frames_num"],
            steps=ip["sample_steps"],
            shift=ip["sample_shift"],
            fps=ip["tgt_fps"],
            audio_window_s=ip["cached_audio_duration"],
            clips=a.clips,
            warmup_clips=a.warmup_clips,
            model=dict(cfg, tiny=a.small),
        ),
        shims=ref.shims,
        small=a.small,
        build_s=build_s,
        fps_steady_rule=f"{ip['frame_num'] - ip['motion_frames_num']} new frames / median wall time of "
        "chunks 2.. (audio window -> frames on the host)",
        ttff_rule="loop start -> the first chunk's new frames on the host (prepare_params before it: "
        "prepare_ms, ttff_with_prepare_ms)",
    )


def compile_seconds() -> dict:
    """Seconds torch.compile spent so far, by phase (``torch._dynamo.utils.compile_times``, aggregated)."""
    from torch._dynamo.utils import compile_times

    heads, values = compile_times(repr="csv", aggregate=True)
    return {h: round(float(v), 3) for h, v in zip(heads, values)}


def main() -> None:
    ap = base_parser(__doc__, "checkout of Soul-AILab/SoulX-FlashHead")
    ap.add_argument("--variant", choices=["pro", "lite"], required=True)
    ap.add_argument("--eager", action="store_true", help="no torch.compile (their default compiles)")
    ap.add_argument(
        "--eager-vae",
        action="store_true",
        help="compile their DiT but leave their VAE's encode/decode eager (a shorter cold start; recorded)",
    )
    ap.add_argument("--clips", type=int, default=10, help="chunks per timed stream")
    ap.add_argument("--warmup-clips", type=int, default=2, help="chunks of the untimed first run")
    a = ap.parse_args()
    if a.clips < 2 or a.warmup_clips < 1:
        ap.error("--clips must be >= 2 and --warmup-clips >= 1")
    ref_dir = a.ref.resolve()
    if not (ref_dir / "flash_head" / "inference.py").is_file():
        ap.error(f"--ref {a.ref}: not a SoulX-FlashHead checkout (scripts/reference_checkouts.sh makes one)")
    commit = checkout_commit(ref_dir, a.commit, "")
    dev = "cpu" if a.small else a.device
    dtype = torch.float32 if a.small else torch.bfloat16
    ref = import_reference(ref_dir, dev)
    torch.set_grad_enabled(False)
    t = time.perf_counter()
    p, cfg = build_pipeline(ref, a.variant, dev, dtype, a.small, not a.eager, a.eager_vae)
    build_s = time.perf_counter() - t
    built(dev)
    spans = Spans(Clock(dev))
    instrument(p, spans)
    compiled: dict = {}

    def one_run(r: int) -> dict:
        if r == 1:
            compiled["warmup"] = compile_seconds()
        return run_stream(ref, p, spans, a.clips if r else a.warmup_clips, image, dev)

    with tempfile.TemporaryDirectory() as tmp:
        image = random_image(Path(tmp), ref.inf.infer_params["height"])
        runs, first_run_s = run_repeats(one_run, max(a.repeats, 1))
    info = meta(ref, a, cfg, commit, dtype, build_s)
    info.update(compile_s_warmup=compiled.get("warmup"), compile_s_total=compile_seconds())
    s = summary(
        info,
        runs,
        first_run_s,
        dev,
        ("audio", "run_pipeline", "denoise", "decode", "encode", "host"),
    )
    report(s, f"flashhead-{a.variant} " + ("eager" if a.eager else "compiled"), a.out)


if __name__ == "__main__":
    main()
