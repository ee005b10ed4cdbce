"""SoulX-FlashHead's diffusion transformer (Soul-AILab/SoulX-FlashHead ``WanModelAudioProject``), built from its folder.

FlashHead is a Wan-2.1-1.3B-style DiT that talks from audio alone (no text, no CLIP):

* input: the noisy latent and the *reference latent* (the VAE encoding of the reference image repeated over
  the clip's frames) concatenated on the channels (``in_dim`` = 2 x ``out_dim``), patchified by a 3-D
  convolution (``patch_size``; computed here as a linear over the flattened patches, the same numbers);
* per block: adaLN self-attention (q/k RMS norms, 3-D RoPE, every token of the clip attends to every other),
  then a cross-attention from each latent frame's tokens to *that frame's* audio tokens only (after an affine
  LayerNorm, their ``norm3``; q/k RMS norms; no gate), then the adaLN GELU feed-forward. The block is
  :class:`cadence.model.dit.Block` with its text cross-attention read per latent frame (``groups``), so the
  elementwise ``ops`` seam, FP8 linears and compile apply to it as to every Wan block;
* audio: the per-video-frame wav2vec2 windows (``cadence.model.flashhead_stream``) regrouped per latent frame
  (``cadence.model.multitalk.latent_audio_windows`` with ``vae_scale`` = ``vae_stride[0]``: 4 for Pro, 8 for
  Lite) and projected by ``AudioProjModel`` (``cadence.model.multitalk.AudioProjection``) to ``audio_tokens``
  tokens of ``audio_width`` per latent frame. The projected tokens' K/V are computed once per clip
  (:meth:`FlashHeadDiT.audio_context`) and read by all its passes;
* one timestep for the whole clip; the sinusoidal embedding in float64 as their code computes it.

Sizes: the transformer's from the folder's ``config.json`` (their ``register_to_config`` fields: dim,
num_heads, num_layers, ffn_dim, freq_dim, eps, in_dim, out_dim, patch_size, vae_stride); the audio
projection's from the weights' shapes (their code hard-codes 5 x 12 x 768 -> 512 -> 32 x 1536; a folder with
other sizes loads here): ``proj1`` [hidden, W x P], ``proj1_vf`` [hidden, (W + s - 1) x P] with
s = ``vae_stride[0]`` give the window W and one frame's feature width P (wav2vec2 layers x channels),
``proj3`` [tokens x width, hidden] with width the cross-attention's K input. ``text_embedding`` and
``audio_emb`` are in the released file but unused by their forward: they are read past, not loaded.
``has_image_input`` true (CLIP tokens) is not FlashHead's and is refused.

Sizes and files (torch-free): ``cadence.model.flashhead_files``. Loading the folder a user downloads
(``Soul-AILab/SoulX-FlashHead-1_3B`` beside ``facebook/wav2vec2-base-960h``): :func:`flashhead_files` finds ``Model_Pro/`` + ``VAE_Wan/Wan2.1_VAE.pth`` or ``Model_Lite/`` + ``VAE_LTX/`` and
the wav2vec2 folder, naming everything missing in one ``ConfigError``; :func:`load_flashhead` builds the DiT,
the clip codec (``cadence.model.flashhead_stream``) and the wav2vec2 features.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from cadence.config import CadenceConfig
from cadence.errors import ConfigError
from cadence.model.dit import Block, CrossAttention, Head, WanDiT, _split_mod
from cadence.model.flashhead_files import (  # noqa: F401 (the sizes and the folder: re-exported)
    RELEASED,
    UNUSED_PREFIXES,
    VARIANTS,
    FlashHeadConfig,
    FlashHeadFiles,
    flashhead_files,
    released_config,
    weight_shapes,
)
from cadence.model.full import FullSequence
from cadence.model.layers import MLP2, Linear
from cadence.model.multitalk import AudioProjection, latent_audio_windows
from cadence.model.rope import Rope3D


def pass_flops(cfg: FlashHeadConfig, video_frames: int, height: int, width: int) -> dict[str, int]:
    """FLOPs of one model pass over a clip (2 per multiply-add; GEMMs and attention only, as
    ``torch.utils.flop_counter`` counts them): ``linear`` (patch embedding, the blocks' projections and FFNs,
    the head, the audio projection), ``attention`` (self-attention over all the clip's tokens, each latent
    frame's cross-attention to its audio tokens) and their ``total``; ``tokens`` for the record."""
    n, d, f = cfg.tokens(video_frames, height, width), cfg.dim, cfg.latent_frames(video_frames)
    ctx = f * cfg.audio_tokens
    audio = (
        cfg.audio_window * cfg.audio_frame_width
        + (f - 1) * (cfg.audio_window + cfg.vae_scale - 1) * cfg.audio_frame_width
    )
    audio = 2 * cfg.audio_hidden * audio + 2 * f * cfg.audio_hidden * (
        cfg.audio_hidden + ctx // f * cfg.audio_width
    )
    per_layer = 2 * n * (4 * d * d + 2 * d * d + 2 * d * cfg.ffn_dim) + 2 * ctx * 2 * cfg.audio_width * d
    linear = (
        2 * n * math.prod(cfg.patch) * (cfg.in_dim + cfg.out_dim) * d + cfg.num_layers * per_layer + audio
    )
    linear += 2 * (cfg.freq_dim * d + d * d + d * 6 * d)  # the timestep MLP and its 6-way projection
    attention = cfg.num_layers * (4 * n * n * d + 4 * n * cfg.audio_tokens * d)
    return {"tokens": n, "linear": linear, "attention": attention, "total": linear + attention}


# ---- the model --------------------------------------------------------------------------------------


class FlashHeadAudioProjection(AudioProjection):
    """Their ``AudioProjModel`` at the sizes the weights carry (``cadence.model.multitalk.AudioProjection``)."""

    def __init__(self, cfg: FlashHeadConfig, device=None, dtype=None):
        nn.Module.__init__(self)
        self._build(
            cfg.audio_window,
            cfg.audio_frame_width,
            cfg.audio_hidden,
            cfg.audio_tokens,
            cfg.audio_width,
            cfg.audio_norm,
            cfg.vae_scale,
            device,
            dtype,
        )


class FlashHeadBlock(Block):
    """A Wan block whose cross-attention reads each latent frame's audio tokens (their ``DiTAudioBlock``):
    ``Block``'s modules and names (``norm2`` is the affine norm before the cross-attention: their ``norm3``)."""

    def __init__(self, cfg: FlashHeadConfig, device=None, dtype=None):
        m = cfg.model_config()
        super().__init__(m, audio=False, device=device, dtype=dtype)
        if cfg.audio_width != cfg.dim:
            self.cross_attn = CrossAttention(m, device, dtype, ctx_dim=cfg.audio_width)

    def forward(self, x, temb6, cache, layer: int, commit: bool, audio_kv, frames: int):
        """x [B, N, dim]; audio_kv: this block's (k, v) of the audio tokens [B * frames, tokens, heads, hd]."""
        mod = _split_mod(self.modulation, temb6)
        ops, eps = self.ops, self.norm1.eps
        h = ops.norm_modulate(x, mod.attn.shift, mod.attn.scale, eps)
        x = ops.gate_residual(x, self.self_attn(h, cache, layer, commit), mod.attn.gate)
        h = ops.layer_norm_cast(x, self.norm2.weight, self.norm2.bias, eps)
        x = x + self.cross_attn(h, audio_kv, groups=frames)
        h = ops.norm_modulate(x, mod.ffn.shift, mod.ffn.scale, eps)
        return ops.gate_residual(x, self.ffn(h), mod.ffn.gate)


class ClipSequence(FullSequence):
    """The whole clip's self-attention (``FullSequence``: no mask), through ``attend_fn(q, k, v, cos, sin) ->
    [B, N, H * D]`` when one is given (a fast path swapped in from outside: :attr:`FlashHeadDiT.clip_attention`),
    else ``FullSequence``'s reference (the complex float32 RoPE, then the attention seam's torch SDPA)."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, attend_fn=None):
        super().__init__(cos, sin)
        self.attend_fn = attend_fn

    def attend(self, layer: int, q, k, v, commit: bool) -> torch.Tensor:
        if self.attend_fn is None:
            return super().attend(layer, q, k, v, commit)
        return self.attend_fn(q, k, v, self.cos, self.sin)


@dataclass
class AudioContext:
    """One clip's audio, ready for every pass: per block the (k, v) of its audio tokens, and the latent frames."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    frames: int


class FlashHeadDiT(nn.Module):
    """FlashHead's transformer (see the module docstring). Construct on any device (``meta`` to load next)."""

    # the same patch layout, timestep embedding and properties as Wan's (they read only mcfg and the modules)
    patchify = WanDiT.patchify
    unpatchify = WanDiT.unpatchify
    time_embedding = WanDiT.time_embedding
    dtype = WanDiT.dtype
    device = WanDiT.device
    #: The whole clip's self-attention with its RoPE, ``(q, k, v [B, N, H, D], cos, sin [N, D / 2]) -> [B, N, H * D]``
    #: (:class:`ClipSequence`); None: the reference. Set from outside (a benchmark's candidate fast path).
    clip_attention = None

    def __init__(self, cfg: FlashHeadConfig, device=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.fcfg = cfg
        m = self.mcfg = cfg.model_config()
        d = cfg.dim
        self.patch_embed = Linear(cfg.in_dim * math.prod(cfg.patch), d, device=device, dtype=dtype)
        self.time_embed = MLP2(cfg.freq_dim, d, d, "silu", device, torch.float32)
        self.time_proj = Linear(d, 6 * d, device=device, dtype=torch.float32)
        self.audio_proj = FlashHeadAudioProjection(cfg, device, dtype)
        self.blocks = nn.ModuleList([FlashHeadBlock(cfg, device, dtype) for _ in range(cfg.num_layers)])
        self.head = Head(m, device, dtype)
        rope_dev = "cpu" if device is None or torch.device(device).type == "meta" else device
        self.rope = Rope3D(m.rope_split, cfg.rope_theta, device=rope_dev)

    def audio_context(self, windows: torch.Tensor) -> AudioContext:
        """Per-video-frame audio windows [B, 1 + s (F - 1), W, layers, C] (s = ``vae_stride[0]``) -> every
        block's K/V of the projected audio tokens (once per clip; every pass reads them)."""
        c = self.fcfg
        if (
            windows.ndim != 5
            or windows.shape[2] != c.audio_window
            or windows[0, 0, 0].numel() != c.audio_frame_width
        ):
            raise ValueError(
                f"audio windows {list(windows.shape)}: this model takes [B, frames, {c.audio_window}, layers, C] "
                f"with layers x C = {c.audio_frame_width}"
            )
        first, later = latent_audio_windows(windows.to(self.dtype), c.vae_scale)
        tokens = self.audio_proj(first, later)  # [B, F, tokens, width]
        flat = tokens.flatten(0, 1)
        return AudioContext([blk.cross_attn.context_kv(flat) for blk in self.blocks], tokens.shape[1])

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, audio: AudioContext | torch.Tensor, ref: torch.Tensor
    ) -> torch.Tensor:
        """One pass: x [B, out_dim, F, h, w] (the noisy latent), t [1] or [B] (0..1000, one per clip), audio
        (:meth:`audio_context`, or the windows), ref [B, in_dim - out_dim, F, h, w] (the reference latent)
        -> the flow prediction [B, out_dim, F, h, w] in the model's dtype."""
        ctx = audio if isinstance(audio, AudioContext) else self.audio_context(audio)
        inp = torch.cat([x.to(self.dtype), ref.to(self.dtype)], dim=1)
        b, _, f, h, w = inp.shape
        pt, ph, pw = self.fcfg.patch
        if f // pt != ctx.frames:
            raise ValueError(f"{f} latent frames but audio for {ctx.frames}")
        tokens = self.patch_embed(self.patchify(inp))
        temb, temb6 = self.time_embedding(t.reshape(-1).expand(b))
        cos, sin = self.rope.cos_sin(torch.arange(f // pt, device=inp.device), h // ph, w // pw)
        seq = ClipSequence(cos, sin, self.clip_attention)
        for i, blk in enumerate(self.blocks):
            tokens = blk(tokens, temb6, seq, i, False, ctx.kv[i], ctx.frames)
        return self.unpatchify(self.head(tokens, temb), f, h, w)


def build_flashhead(
    cfg: FlashHeadConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> FlashHeadDiT:
    """A randomly initialised DiT of ``cfg`` on ``device`` (``cadence.model.weights.init_random``'s scheme),
    built on ``meta`` first: no CPU copy of a 1.5B model."""
    from cadence.model.weights import init_random

    with torch.device("meta"):
        model = FlashHeadDiT(cfg, device="meta", dtype=dtype)
    model = model.to_empty(device=torch.device(device))
    model.rope.to(device)
    init_random(model, seed)
    return model.eval().requires_grad_(False)


# ---- loading -------------------------------------------------------------------------------------------


@torch.no_grad()
def load_flashhead_model(
    folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16
) -> FlashHeadDiT:
    """Their model folder (``Model_Pro/`` or ``Model_Lite/``: config.json + safetensors, their names) -> the
    DiT on ``device`` in ``dtype`` (norms, modulation tables and the timestep MLP in float32). Built on
    ``meta`` and allocated on the device: nothing is built twice."""
    from cadence.model.weights import _read_safetensors, load_state_dict_into

    folder = Path(folder)
    cfg = FlashHeadConfig.from_folder(folder)
    with torch.device("meta"):
        model = FlashHeadDiT(cfg, device="meta", dtype=dtype)
    model = model.to_empty(device=torch.device(device))
    model.rope.to(device)
    sd = {k: v for k, v in _read_safetensors(folder).items() if not k.startswith(UNUSED_PREFIXES)}
    load_state_dict_into(model, sd, "wan", allow_missing_audio=False)
    return model.eval().requires_grad_(False)


def build_for_engine(layout, cfg: CadenceConfig, device, dtype: torch.dtype, seed: int = 0) -> FlashHeadDiT:
    """The families' model builder (``cadence.model.flashhead_files.FlashHeadLayout.build``, called by the
    engine): the DiT of ``cfg``, loaded from the released folder at ``cfg.model.weights`` (its variant's model
    folder; ``FlashHeadLayout.configure`` folded its sizes into ``cfg``) or random from ``seed``."""
    if cfg.model.weights:
        return load_flashhead_model(flashhead_files(cfg.model.weights, layout.variant).model, device, dtype)
    return build_flashhead(FlashHeadConfig.from_engine(cfg), device, dtype, seed)


def load_ltx_codec(folder: str | Path, device, dtype: torch.dtype):
    """Lite's clip codec: the LTX-Video VAE folder (``cadence.model.ltx_vae``) as
    ``cadence.model.flashhead_stream.LTXClipCodec``."""
    try:
        from cadence.model.ltx_vae import LTXVideoVAE
    except ImportError:
        raise ConfigError(
            "FlashHead lite decodes with the LTX-Video VAE (cadence.model.ltx_vae), not in this build"
        ) from None
    from cadence.model.flashhead_stream import LTXClipCodec

    return LTXClipCodec(LTXVideoVAE.from_folder(folder, device, dtype))


@dataclass
class FlashHeadParts:
    """A loaded FlashHead: the DiT, its clip codec (decode + encode), the wav2vec2 features and the files."""

    model: FlashHeadDiT
    codec: object
    features: object
    files: FlashHeadFiles

    @property
    def cfg(self) -> FlashHeadConfig:
        return self.model.fcfg


def load_flashhead(
    root: str | Path,
    variant: str,
    wav2vec2: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    ltx_loader=None,
) -> FlashHeadParts:
    """The released folder (:func:`flashhead_files`) -> :class:`FlashHeadParts`. Pro's codec is Cadence's Wan
    2.1 VAE (``cadence.model.vae``); Lite's is ``ltx_loader(folder, device, dtype)`` (any object with the
    codec's ``encode`` / ``decode``: ``cadence.model.flashhead_stream``), by default :func:`load_ltx_codec`. wav2vec2 runs in float32, as their pipeline runs it."""
    from cadence.model.flashhead_stream import WanClipCodec
    from cadence.model.wav2vec2 import Wav2Vec2Features

    files = flashhead_files(root, variant, wav2vec2)
    model = load_flashhead_model(files.model, device, dtype)
    features = Wav2Vec2Features(files.wav2vec2, fps=25, device=device)
    wc = features.model.config
    if wc.num_hidden_layers * wc.hidden_size != model.fcfg.audio_frame_width:
        raise ConfigError(
            f"the wav2vec2 folder {files.wav2vec2} gives {wc.num_hidden_layers} layers of {wc.hidden_size} per "
            f"frame; {files.model.name} reads {model.fcfg.audio_frame_width} features per frame"
        )
    if files.variant == "pro":
        from cadence.model.vae import load_wan_vae

        codec = WanClipCodec(load_wan_vae(files.vae, device=device, dtype=dtype))
    else:
        if ltx_loader is None:
            ltx_loader = load_ltx_codec
        codec = ltx_loader(files.vae, device, dtype)
    return FlashHeadParts(model, codec, features, files)
