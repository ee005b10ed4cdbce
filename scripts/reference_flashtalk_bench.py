"""SoulX-FlashTalk's own streaming clip loop on one GPU, timed (the families' side-by-side; not part of Cadence).

    python scripts/reference_flashtalk_bench.py --ref /path/to/SoulX-FlashTalk [--compile] [--clips 3] \
        [--repeats 2] [--out ref.json] [--small]

``--ref`` is a checkout of Soul-AILab/SoulX-FlashTalk (imported from there, never copied). The script runs
what its ``inference_script_single_gpu.sh`` runs (``generate_video.py --audio_encode_mode stream`` on one
GPU), with random weights: its ``FlashTalkPipeline`` (assembled without ``__init__``, which loads T5, CLIP,
the VAE, the 14B model and wav2vec2 from disk) prepared by its own ``prepare_params`` (768x448, 33-frame clips
with 5 motion frames, 4 steps shifted by 5, colour correction 1.0: ``flash_talk/configs/infer_params.yaml``;
the I2V condition and motion latents encoded by its ``WanVAE``), then per clip the stream branch of
``generate_video.generate``, re-typed (that file also loads the model files and writes the mp4): 28 new
frames of 16 kHz audio into the 8 s ``deque``, ``flash_talk.inference.get_audio_embedding`` (pyloudnorm
loudness normalisation, the wav2vec2 feature extractor and its ``Wav2Vec2Model`` over the whole 8 s window,
the last 33 frames' windows) and ``flash_talk.inference.run_pipeline`` (``FlashTalkPipeline.generate``: 4
passes of InfiniteTalk's ``WanModel`` (Wan2.1-I2V-14B sizes + the audio cross-attention) over the
bidirectional 9-latent-frame clip, the clip decoded by its Wan VAE, colour-matched, the last 5 frames encoded
into the next clip's motion latents), the frames copied to the host. ``--compile`` is what its pipeline
constructor does (``COMPILE_MODEL`` / ``COMPILE_VAE``: ``torch.compile`` of the model and of the VAE's
``encode`` / ``decode``); the pipeline runs bf16 (``multitalk_14B.param_dtype``).

What differs from its run, outside its math: random weights (the 14B made on the GPU in float32, + N(0,
0.05^2), cast to bf16); a random Wan 2.1 VAE in its ``WanVAE_``; a random wav2vec2-base-sized ``Wav2Vec2Model``); T5 and
CLIP are stubs returning a fixed random [512, 4096] prompt embedding and [1, 257, 1280] image tokens (both run
once per stream in ``prepare_params``, outside the clip loop); the audio is random 16 kHz noise, not a wav
file; ``xfuser`` (sequence parallelism, unused on one GPU) is a stub. Attention: its ``flash_attention``
(flash-attn, absent on the GPU machine) and xformers' ``memory_efficient_attention`` (its audio
cross-attention; absent too) are torch SDPA in the inputs' dtype. ``--small`` (CPU): the fixture's tiny sizes
(scripts/fixtures/make_flashtalk.py), a 32x32 frame, float32, torchvision's ``center_crop`` a stand-in when
torchvision is absent.

Timing (scripts/reference_common.py): per clip the host wall time (audio window -> frames on the host) and
CUDA-event spans of the audio embedding, the 4 model passes, the decode, the motion encode; ``ttff_ms`` from
the clip loop's start (``prepare_ms``: ``prepare_params`` before it); 28 frames a clip at 25 fps."""

from __future__ import annotations

import os
import sys
import time
import types
from collections import deque
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "fixtures")]
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

I2V14 = dict(dim=5120, num_heads=40, ffn_dim=13824, num_layers=40, freq_dim=256, text_dim=4096, text_len=512)
CLIP_TOKENS, CLIP_DIM = 257, 1280


def stub(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def sdpa_bmhk(q, k, v, *args, **kwargs):
    """[B, M, H, K] attention in the inputs' dtype; these paths pass no lengths, masks or biases."""
    if (
        kwargs.get("attn_bias") is not None
        or kwargs.get("k_lens") is not None
        or kwargs.get("q_lens") is not None
    ):
        raise NotImplementedError("SDPA shim: lengths / masks are not used on this path")
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(
        1, 2
    )


_checked = []


def full_length_sdpa(q, k, v, k_lens=None, window_size=(-1, -1)):
    """Wan's ``flash_attention`` as these paths call it: ``k_lens`` is every sequence's full length (one clip,
    no padding: checked on the first call, so no sync afterwards), no window."""
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError("SDPA shim: no sliding window on this path")
    if k_lens is not None and not _checked:
        if not bool((k_lens == k.shape[1]).all()):
            raise NotImplementedError("SDPA shim: padded keys are not used on this path")
        _checked.append(True)
    return sdpa_bmhk(q, k, v)


def center_crop(img, output_size):
    """torchvision's ``transforms.functional.center_crop`` on a [..., H, W] tensor (--small without it)."""
    th, tw = output_size
    h, w = img.shape[-2:]
    top, left = int(round((h - th) / 2.0)), int(round((w - tw) / 2.0))
    return img[..., top : top + th, left : left + tw]


def import_reference(ref: Path):
    """Its modules: the packages bare (their __init__ import T5, CLIP and VACE), xfuser stubbed, the missing
    optional attention libraries replaced by SDPA; ``flash_talk.inference`` imported from the checkout's
    folder (it reads ``flash_talk/configs/infer_params.yaml`` relative to the working directory)."""
    for name, path in [
        ("flash_talk", ref / "flash_talk"),
        ("flash_talk.wan", ref / "flash_talk/wan"),
        ("flash_talk.wan.modules", ref / "flash_talk/wan/modules"),
    ]:
        stub(name, __path__=[str(path)])
    sys.path.insert(0, str(ref))
    # before any stub: diffusers and transformers probe for torchvision by its import spec
    from diffusers import ModelMixin  # noqa: F401
    from transformers import Wav2Vec2FeatureExtractor  # noqa: F401
    from transformers.models.wav2vec2 import modeling_wav2vec2  # noqa: F401

    shims = ["flash_talk packages bare", "xfuser stubbed (sequence parallelism only)"]
    stub("xfuser")
    stub("xfuser.core")
    stub(
        "xfuser.core.distributed",
        get_sequence_parallel_rank=lambda: 0,
        get_sequence_parallel_world_size=lambda: 1,
        get_sp_group=lambda: None,
    )
    stub("xfuser.core.long_ctx_attention", xFuserLongContextAttention=None)
    try:
        import xformers.ops  # noqa: F401

        xformers_note = "xformers (installed)"
    except ImportError:
        stub("xformers").ops = stub("xformers.ops", memory_efficient_attention=sdpa_bmhk)
        xformers_note = "xformers.ops.memory_efficient_attention -> torch SDPA (xformers not installed)"
    for name in ("torchvision", "skimage", "imageio"):
        try:
            __import__(name)
        except ImportError:  # --small on a machine without them (the GPU machine has all three)
            if name == "torchvision":
                tv = stub("torchvision")
                tv.transforms = stub("torchvision.transforms")
                tv.transforms.functional = stub("torchvision.transforms.functional", center_crop=center_crop)
            else:
                stub(name, color=None)
            shims.append(f"{name} stubbed (absent here)")
    import flash_talk.wan.modules.vae as vae_mod

    sys.modules["flash_talk.wan.modules"].__dict__.update(
        CLIPModel=None, T5EncoderModel=None, WanVAE=vae_mod.WanVAE
    )
    import flash_talk.infinite_talk.modules.multitalk_model as mm
    import flash_talk.src.pipeline.flash_talk_pipeline as fp

    cwd = os.getcwd()
    os.chdir(ref)
    try:
        import flash_talk.inference as fi
    finally:
        os.chdir(cwd)
    import flash_talk.wan.modules.attention as wattn

    if wattn.FLASH_ATTN_2_AVAILABLE or wattn.FLASH_ATTN_3_AVAILABLE:
        attention = f"flash-attn (installed); {xformers_note}"
    else:
        mm.flash_attention = full_length_sdpa
        attention = (
            f"flash_attention -> torch SDPA in the inputs' dtype (flash-attn not installed); {xformers_note}"
        )
    from flash_talk.infinite_talk.audio_analysis.wav2vec2 import Wav2Vec2Model

    return types.SimpleNamespace(
        mm=mm, fp=fp, fi=fi, vae_mod=vae_mod, W2V=Wav2Vec2Model, attention=attention, shims=shims
    )


def build_model(ref, dev: str, dtype, small: bool):
    """InfiniteTalk's ``WanModel`` with random weights, made on the device in the pipeline's dtype."""
    if small:
        import make_flashtalk as mf

        torch.manual_seed(0)
        model = ref.mm.WanModel(**mf.TINY)
        t = mf.TINY
        model.audio_proj = ref.mm.AudioProjModel(
            seq_len=t["audio_window"],
            seq_len_vf=t["audio_window"] + t["vae_scale"] - 1,
            blocks=mf.AUDIO_LAYERS,
            channels=mf.AUDIO_CHANNELS,
            intermediate_dim=t["intermediate_dim"],
            output_dim=t["output_dim"],
            context_tokens=t["context_tokens"],
            norm_output_audio=t["norm_output_audio"],
        )
        model.img_emb = ref.mm.MLPProj(mf.CLIP_DIM, t["dim"])
        perturb_(model)
        return model.eval().requires_grad_(False), mf
    with torch.device(dev):  # float32, then cast as from_pretrained(torch_dtype=bf16) leaves it
        torch.manual_seed(0)
        model = ref.mm.WanModel(model_type="i2v", in_dim=36, out_dim=16, **I2V14)
        perturb_(model)
    return model.to(dtype).eval().requires_grad_(False), None


def build_pipeline(ref, dev: str, dtype, small: bool, compile_: bool):
    from transformers import Wav2Vec2Config, Wav2Vec2FeatureExtractor

    model, mf = build_model(ref, dev, dtype, small)
    cfg = (
        ref.fi.multitalk_14B
    )  # flash_talk/infinite_talk/configs/wan_multitalk_14B.py, as get_pipeline takes it
    vae_dim = mf.VAE_TINY["dim"] if small else 96
    real = ref.vae_mod._video_vae
    ref.vae_mod._video_vae = lambda **kw: random_wan_vae(ref.vae_mod.WanVAE_, vae_dim)  # no .pth to read
    try:
        vae = ref.vae_mod.WanVAE(vae_path="(random)", dtype=dtype, device=dev)
    finally:
        ref.vae_mod._video_vae = real
    w2v = (
        dict(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, intermediate_size=16) if small else {}
    )
    if small:
        w2v.update(conv_dim=(16,) * 7, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2)
    torch.manual_seed(2)
    audio = ref.W2V(Wav2Vec2Config(**w2v)).to(dev).eval()  # chinese-wav2vec2-base: the base sizes (12 x 768)
    audio.feature_extractor._freeze_parameters()
    hidden_states_shim(audio, ref.shims)
    p = ref.fp.FlashTalkPipeline.__new__(ref.fp.FlashTalkPipeline)
    p.device, p.config, p.rank, p.use_usp, p.param_dtype, p.cpu_offload = dev, cfg, 0, False, dtype, False
    p.vae_stride, p.patch_size, p.vae, p.model, p.sp_size = cfg.vae_stride, cfg.patch_size, vae, model, 1
    p.sample_neg_prompt, p.num_timesteps, p.use_timestep_transform = cfg.sample_neg_prompt, 1000, True
    if compile_ and ref.fp.COMPILE_MODEL:  # FlashTalkPipeline.__init__
        p.model = torch.compile(p.model)
    if compile_ and ref.fp.COMPILE_VAE:
        p.vae.encode = torch.compile(p.vae.encode)
        p.vae.decode = torch.compile(p.vae.decode)
    p.audio_encoder, p.wav2vec_feature_extractor = audio, Wav2Vec2FeatureExtractor()
    return p, mf


def hidden_states_shim(audio, shims: list) -> None:
    """transformers >= 5 collects ``hidden_states`` in a decorator of ``Wav2Vec2Model.forward``, which
    FlashTalk's subclass overrides (written for transformers 4.x): its encoder call then returns none and
    ``preprocess_audio`` fails. Forward hooks hand the encoder's output the tuple transformers 4 built (the
    input of the first layer, then every layer's output); the computation is unchanged."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        return
    seen: list = []
    layers = audio.encoder.layers
    layers[0].register_forward_pre_hook(lambda m, args, kwargs: seen.append(args[0]), with_kwargs=True)
    for layer in layers:
        layer.register_forward_hook(
            lambda m, args, out: seen.append(out[0] if isinstance(out, tuple) else out)
        )

    def fill(m, args, out):
        if getattr(out, "hidden_states", None) is None:
            out.hidden_states = tuple(seen)
        seen.clear()
        return out

    audio.encoder.register_forward_hook(fill)
    shims.append(
        f"transformers {transformers.__version__}: the wav2vec2 encoder's hidden_states handed back by forward hooks "
        "(FlashTalk's Wav2Vec2Model subclass is written for transformers 4.x)"
    )


class Stubs:
    """T5 and CLIP as ``prepare_params`` calls them: a fixed prompt embedding and image tokens."""

    def __init__(self, text, clip):
        self.text, self.clip_tokens = text, clip
        self.visual = lambda img: self.clip_tokens

    def __call__(self, prompts, device):
        return [self.text]


def instrument(p, spans: Spans):
    p.model = spans.wrap("denoise", p.model)
    p.vae.decode = spans.wrap("decode", p.vae.decode)
    p.vae.encode = spans.wrap("encode", p.vae.encode)


@torch.no_grad()
def run_stream(ref, p, spans, stubs, clips: int, size, seed: int, dev: str) -> dict:
    """prepare_params, then the stream branch of generate_video.generate for ``clips`` clips."""
    ip = ref.fi.infer_params
    sr, fps, cached = ip["sample_rate"], ip["tgt_fps"], ip["cached_audio_duration"]
    frame_num, motion = ip["frame_num"], ip["motion_frames_num"]
    from PIL import Image

    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (size[0], size[1], 3), dtype=np.uint8))
    p.text_encoder = p.clip = stubs
    sync(dev)
    t = time.perf_counter()
    p.prepare_params(
        input_prompt="A person is talking.",
        cond_image=image,
        target_size=size,
        frame_num=frame_num,
        motion_frames_num=motion,
        sampling_steps=ip["sample_steps"],
        seed=9999 + seed,
        shift=ip["sample_shift"],
        color_correction_strength=ip["color_correction_strength"],
    )
    sync(dev)
    prepare_ms = (time.perf_counter() - t) * 1e3
    audio_end = cached * fps
    audio_start = audio_end - frame_num
    dq = deque([0.0] * (sr * cached), maxlen=sr * cached)
    piece = (frame_num - motion) * sr // fps
    speech = (rng.standard_normal(piece * clips) * 0.1).astype(np.float32).reshape(clips, piece)
    out, first = [], None
    t_start = time.perf_counter()
    for i in range(clips):
        spans.clear()
        t0 = time.perf_counter()
        a = spans.clock.mark()
        dq.extend(speech[i].tolist())
        emb = ref.fi.get_audio_embedding(p, np.array(dq), audio_start, audio_end)
        b = spans.clock.mark()
        host = ref.fi.run_pipeline(p, emb).cpu()
        t1 = time.perf_counter()
        first = first if first is not None else t1 - t_start
        sync(dev)
        sp = spans.read()
        out.append(
            dict(
                block=i,
                frames=int(host.shape[0]),
                wall_ms=(t1 - t0) * 1e3,
                audio_ms=spans.clock.ms(a, b),
                denoise_ms=sum(x["ms"] for x in sp if x["name"] == "denoise"),
                decode_ms=sum(x["ms"] for x in sp if x["name"] == "decode"),
                encode_ms=sum(x["ms"] for x in sp if x["name"] == "encode"),
                passes=sum(x["name"] == "denoise" for x in sp),
                finite=bool(torch.isfinite(host).all()),
            )
        )
    return stream_result(out, time.perf_counter() - t_start, first, frame_num - motion, prepare_ms=prepare_ms)


def main() -> None:
    ap = base_parser(__doc__, "checkout of Soul-AILab/SoulX-FlashTalk")
    ap.add_argument("--compile", action="store_true", help="its pipeline's COMPILE_MODEL / COMPILE_VAE")
    ap.add_argument("--clips", type=int, default=3, help="clips per stream (28 new frames each)")
    a = ap.parse_args()
    ref_dir = a.ref.resolve()
    commit = checkout_commit(ref_dir, a.commit, "")
    dev = "cpu" if a.small else a.device
    dtype = torch.float32 if a.small else torch.bfloat16
    ref = import_reference(ref_dir)
    if a.small:  # its generate() syncs CUDA around every pass (timing prints)
        torch.cuda.synchronize = lambda *args, **kw: None
        ref.shims.append("torch.cuda.synchronize a no-op (CPU)")
    torch.set_grad_enabled(False)
    t = time.perf_counter()
    p, mf = build_pipeline(ref, dev, dtype, a.small, a.compile)
    build_s = time.perf_counter() - t
    built(dev)
    g = torch.Generator().manual_seed(1)
    if a.small:
        size = (mf.LATENT_HW[0] * 8, mf.LATENT_HW[1] * 8)
        text = torch.randn(5, mf.TINY["text_dim"], generator=g)
        clip = torch.randn(1, CLIP_TOKENS, mf.CLIP_DIM, generator=g)
    else:
        size = (ref.fi.infer_params["height"], ref.fi.infer_params["width"])
        text = torch.randn(I2V14["text_len"], I2V14["text_dim"], generator=g)
        clip = torch.randn(1, CLIP_TOKENS, CLIP_DIM, generator=g)
    stubs = Stubs(text.to(dev, dtype), clip.to(dev, dtype))
    spans = Spans(Clock(dev))
    instrument(p, spans)
    runs, first_run_s = run_repeats(
        lambda r: run_stream(ref, p, spans, stubs, a.clips, size, r, dev), a.repeats
    )
    ip = ref.fi.infer_params
    meta = dict(
        reference="Soul-AILab/SoulX-FlashTalk",
        reference_commit=commit,
        harness="scripts/reference_flashtalk_bench.py (generate_video.py stream mode: get_audio_embedding + "
        "run_pipeline per clip)",
        dtype=str(dtype).removeprefix("torch."),
        compile="COMPILE_MODEL / COMPILE_VAE (torch.compile default)" if a.compile else None,
        attention=ref.attention,
        decoder="flash_talk WanVAE.decode (Wan 2.1, whole 33-frame clip) + motion encode",
        geometry=dict(
            frame=list(size),
            frame_num=ip["frame_num"],
            motion_frames=ip["motion_frames_num"],
            steps=ip["sample_steps"],
            shift=ip["sample_shift"],
            fps=ip["tgt_fps"],
            clips=a.clips,
            model="tiny (the fixture's)" if a.small else "Wan2.1-I2V-14B sizes + audio",
        ),
        shims=ref.shims,
        small=a.small,
        build_s=build_s,
        fps_steady_rule="28 frames / median wall time of clips 2..",
    )
    s = summary(meta, runs, first_run_s, dev, ("audio", "denoise", "decode", "encode"))
    report(s, "compiled" if a.compile else "eager", a.out)


if __name__ == "__main__":
    main()
