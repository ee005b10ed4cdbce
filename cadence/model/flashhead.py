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

Loading the folder a user downloads (``Soul-AILab/SoulX-FlashHead-1_3B`` beside ``facebook/wav2vec2-base-960h``):
:func:`flashhead_files` finds ``Model_Pro/`` + ``VAE_Wan/Wan2.1_VAE.pth`` or ``Model_Lite/`` + ``VAE_LTX/`` and
the wav2vec2 folder, naming everything missing in one ``ConfigError``; :func:`load_flashhead` builds the DiT,
the clip codec (``cadence.model.flashhead_stream``) and the wav2vec2 features.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from cadence.config import ModelConfig
from cadence.errors import ConfigError, WeightsError
from cadence.model.dit import Block, CrossAttention, Head, WanDiT, _split_mod
from cadence.model.full import FullSequence
from cadence.model.layers import MLP2, Linear
from cadence.model.multitalk import AudioProjection, latent_audio_windows
from cadence.model.rope import Rope3D

#: config.json fields the model needs (their ``WanModelAudioProject.__init__`` arguments).
CONFIG_FIELDS = (
    "dim",
    "num_heads",
    "num_layers",
    "ffn_dim",
    "freq_dim",
    "eps",
    "in_dim",
    "out_dim",
    "patch_size",
    "vae_stride",
)
#: Keys of the released file that their forward never reads (a text MLP and an audio MLP kept from training).
UNUSED_PREFIXES = ("text_embedding.", "audio_emb.")
VARIANTS = {"pro": ("Model_Pro", "VAE_Wan"), "lite": ("Model_Lite", "VAE_LTX")}


@dataclass(frozen=True)
class FlashHeadConfig:
    """FlashHead's geometry: the transformer's from config.json, the audio projection's from the weights."""

    dim: int
    num_heads: int
    num_layers: int
    ffn_dim: int
    freq_dim: int
    eps: float
    in_dim: int
    """Channels into the patch embedding: the noisy latent's and the reference latent's."""
    out_dim: int
    """Latent channels (the VAE's z): 16 (Wan 2.1, Pro) or 128 (LTX-Video, Lite)."""
    patch: tuple[int, int, int]
    vae_stride: tuple[int, int, int]
    """The VAE's compression (frames, height, width): (4, 8, 8) Wan 2.1, (8, 32, 32) LTX-Video."""
    audio_window: int = 5
    """wav2vec2 frames around each video frame (t-2 .. t+2)."""
    audio_frame_width: int = 12 * 768
    """One video frame's audio features: wav2vec2 layers x channels."""
    audio_hidden: int = 512
    audio_tokens: int = 32
    audio_width: int = 1536
    audio_norm: bool = True
    rope_theta: float = 10_000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    @property
    def vae_scale(self) -> int:
        """Video frames per latent frame after the first."""
        return self.vae_stride[0]

    def latent_frames(self, video_frames: int) -> int:
        return (video_frames - 1) // self.vae_scale + 1

    def motion_frames(self, motion_latents: int = 2) -> int:
        """Video frames re-encoded into ``motion_latents`` latent frames (their ``motion_frames_num``:
        (2 - 1) x 4 + 1 = 5 for Pro, x 8 + 1 = 9 for Lite)."""
        return (motion_latents - 1) * self.vae_scale + 1

    def tokens(self, video_frames: int, height: int, width: int) -> int:
        """Transformer tokens of one clip of ``video_frames`` frames at height x width pixels."""
        st, sh, sw = self.vae_stride
        pt, ph, pw = self.patch
        return (self.latent_frames(video_frames) // pt) * (height // sh // ph) * (width // sw // pw)

    def model_config(self) -> ModelConfig:
        """The Wan block geometry (``cadence.model.dit`` pieces read it)."""
        return ModelConfig(
            dim=self.dim,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            ffn_dim=self.ffn_dim,
            num_layers=self.num_layers,
            patch=self.patch,
            in_channels=self.out_dim,
            out_channels=self.out_dim,
            cond_channels=self.in_dim - self.out_dim,
            freq_dim=self.freq_dim,
            eps=self.eps,
            rope_theta=self.rope_theta,
            audio_every=0,
            cross_attn_norm=True,
            image_tokens=0,
            time_embed_fp64=True,
        )

    @classmethod
    def from_folder(cls, folder: str | Path) -> FlashHeadConfig:
        """Their model folder (config.json + safetensors): the sizes, checked against the weights' shapes."""
        folder = Path(folder)
        try:
            raw = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"FlashHead model folder {folder}: cannot read config.json ({e})") from None
        return cls.from_config(raw, weight_shapes(folder), str(folder))

    @classmethod
    def from_config(
        cls, raw: dict, shapes: dict[str, tuple[int, ...]], where: str = "config"
    ) -> FlashHeadConfig:
        """config.json's fields + the weights' shapes (name -> shape, their names) -> the geometry."""
        missing = [k for k in CONFIG_FIELDS if k not in raw]
        if missing:
            raise ConfigError(f"FlashHead {where}: config.json lacks {', '.join(missing)}")
        if raw.get("has_image_input"):
            raise ConfigError(
                f"FlashHead {where}: has_image_input is true (CLIP tokens): not a FlashHead model"
            )
        patch, stride = tuple(int(v) for v in raw["patch_size"]), tuple(int(v) for v in raw["vae_stride"])
        if len(patch) != 3 or len(stride) != 3 or stride[0] < 2:
            raise ConfigError(
                f"FlashHead {where}: patch_size {patch} / vae_stride {stride} are not 3-D video sizes"
            )
        dim, heads = int(raw["dim"]), int(raw["num_heads"])
        if dim % heads or (dim // heads) % 2:
            raise ConfigError(f"FlashHead {where}: dim {dim} does not split into {heads} even heads")
        cfg = cls(
            dim=dim,
            num_heads=heads,
            num_layers=int(raw["num_layers"]),
            ffn_dim=int(raw["ffn_dim"]),
            freq_dim=int(raw["freq_dim"]),
            eps=float(raw["eps"]),
            in_dim=int(raw["in_dim"]),
            out_dim=int(raw["out_dim"]),
            patch=patch,
            vae_stride=stride,
            **audio_sizes(shapes, stride[0], where),
        )
        check_shapes(cfg, shapes, where)
        return cfg


def weight_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the folder's safetensors files (headers only: nothing is read into memory)."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise WeightsError(f"FlashHead model folder {folder}: no .safetensors file")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as fh:
                for k in fh.keys():
                    shapes[k] = tuple(fh.get_slice(k).get_shape())
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise WeightsError(f"cannot read checkpoint {f}: {e}") from None
    return shapes


def audio_sizes(shapes: dict[str, tuple[int, ...]], vae_scale: int, where: str) -> dict:
    """The audio projection's sizes from its weights (see the module docstring)."""
    need = ("audio_proj.proj1.weight", "audio_proj.proj1_vf.weight", "audio_proj.proj3.weight")
    need += ("blocks.0.cross_attn.k.weight",)
    missing = [k for k in need if k not in shapes]
    if missing:
        raise WeightsError(f"FlashHead {where}: the weights lack {', '.join(missing)}")
    hidden, first_in = shapes["audio_proj.proj1.weight"]
    later_in = shapes["audio_proj.proj1_vf.weight"][1]
    frame_width, rest = divmod(later_in - first_in, vae_scale - 1)
    window = first_in // frame_width if frame_width > 0 else 0
    if rest or frame_width <= 0 or window * frame_width != first_in or window % 2 == 0:
        raise WeightsError(
            f"FlashHead {where}: audio_proj.proj1 takes {first_in} and proj1_vf {later_in} features: not an odd "
            f"window W of P features and W + {vae_scale - 1} of them (vae_stride[0] {vae_scale})"
        )
    width = shapes["blocks.0.cross_attn.k.weight"][1]
    tokens, rest = divmod(shapes["audio_proj.proj3.weight"][0], width)
    if rest:
        raise WeightsError(
            f"FlashHead {where}: audio_proj.proj3 makes {tokens * width + rest} values, not tokens of {width}"
        )
    return dict(
        audio_window=window,
        audio_frame_width=frame_width,
        audio_hidden=hidden,
        audio_tokens=tokens,
        audio_width=width,
        audio_norm="audio_proj.norm.weight" in shapes,
    )


def check_shapes(cfg: FlashHeadConfig, shapes: dict[str, tuple[int, ...]], where: str) -> None:
    """config.json against the weights: the patch convolution, the depth, the FFN and the head."""
    d = cfg.dim
    expect = {
        "patch_embedding.weight": (d, cfg.in_dim, *cfg.patch),
        "blocks.0.ffn.0.weight": (cfg.ffn_dim, d),
        "head.head.weight": (cfg.out_dim * math.prod(cfg.patch), d),
        "time_embedding.0.weight": (d, cfg.freq_dim),
    }
    wrong = [f"{k}: weights {shapes.get(k)} vs config {v}" for k, v in expect.items() if shapes.get(k) != v]
    depth = len({k.split(".")[1] for k in shapes if k.startswith("blocks.")})
    if depth != cfg.num_layers:
        wrong.append(f"{depth} blocks in the weights vs num_layers {cfg.num_layers}")
    if wrong:
        raise WeightsError(f"FlashHead {where}: config.json does not fit the weights: {'; '.join(wrong)}")


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
        seq = FullSequence(cos, sin)
        for i, blk in enumerate(self.blocks):
            tokens = blk(tokens, temb6, seq, i, False, ctx.kv[i], ctx.frames)
        return self.unpatchify(self.head(tokens, temb), f, h, w)


#: The released geometry (config.json as their ``WanModelAudioProject`` takes it, inferred: Wan2.1-1.3B's sizes;
#: Lite on the LTX-Video VAE's 128 channels at 8 x 32 x 32 with one token per latent position, the "8192 : 1
#: pixel-to-token ratio" of their report) with their hard-coded audio projection (5 x 12 x 768 -> 512 -> 32 x 1536).
RELEASED = {
    "pro": dict(in_dim=32, out_dim=16, patch=(1, 2, 2), vae_stride=(4, 8, 8)),
    "lite": dict(in_dim=256, out_dim=128, patch=(1, 1, 1), vae_stride=(8, 32, 32)),
}


def released_config(variant: str) -> FlashHeadConfig:
    """The geometry of a released variant ('pro' / 'lite') for random-weight runs (benchmarks); a real folder
    is read by :meth:`FlashHeadConfig.from_folder`."""
    if variant not in RELEASED:
        raise ConfigError(f"FlashHead variant {variant!r}: choose 'pro' or 'lite'")
    base = dict(dim=1536, num_heads=12, num_layers=30, ffn_dim=8960, freq_dim=256, eps=1e-6)
    return FlashHeadConfig(**base, **RELEASED[variant])


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


@dataclass(frozen=True)
class FlashHeadFiles:
    """Where a released FlashHead lives: the variant's model folder, its VAE and the wav2vec2 folder."""

    variant: str
    model: Path
    vae: Path
    wav2vec2: Path


def _wav2vec2_folders(places: list[Path]) -> list[Path]:
    return [
        d
        for base in places
        if base.is_dir()
        for d in sorted(base.iterdir())
        if d.is_dir() and "wav2vec2" in d.name.lower() and (d / "config.json").is_file()
    ]


def flashhead_files(root: str | Path, variant: str, wav2vec2: str | Path | None = None) -> FlashHeadFiles:
    """The files of ``variant`` ('pro' or 'lite') in ``root`` (the downloaded ``SoulX-FlashHead-1_3B`` folder,
    or its ``Model_Pro`` / ``Model_Lite`` folder): ``Model_Pro/`` + ``VAE_Wan/Wan2.1_VAE.pth`` or ``Model_Lite/``
    + ``VAE_LTX/`` (with its config.json), and ``wav2vec2`` (else a folder named ``*wav2vec2*`` with a
    config.json in ``root`` or beside it: the README downloads ``wav2vec2-base-960h`` next to the model).
    Everything missing is named in one ``ConfigError``."""
    v = str(variant).lower()
    if v not in VARIANTS:
        raise ConfigError(f"FlashHead variant {variant!r}: choose 'pro' or 'lite'")
    model_name, vae_name = VARIANTS[v]
    root = Path(root)
    if root.name in (n for n, _ in VARIANTS.values()):
        root = root.parent
    if not root.is_dir():
        raise ConfigError(f"FlashHead weights {root}: not a folder")
    model = root / model_name
    vae = root / vae_name / "Wan2.1_VAE.pth" if v == "pro" else root / vae_name
    missing = []
    if not (model / "config.json").is_file() or not any(model.glob("*.safetensors")):
        missing.append(f"{model_name}/ (config.json + .safetensors)")
    if v == "pro" and not vae.is_file():
        missing.append(f"{vae_name}/Wan2.1_VAE.pth")
    if v == "lite" and not (vae / "config.json").is_file():
        missing.append(f"{vae_name}/ (the LTX-Video VAE folder, with config.json)")
    if wav2vec2 is not None:
        w2v = Path(wav2vec2)
        if not (w2v / "config.json").is_file():
            missing.append(f"the wav2vec2 folder {w2v} (config.json)")
    else:
        found = _wav2vec2_folders([root, root.parent])
        w2v = found[0] if found else root.parent / "wav2vec2-base-960h"
        if not found:
            missing.append(
                f"a wav2vec2 folder (wav2vec2-base-960h/ with config.json) in {root} or {root.parent}"
            )
    if missing:
        raise ConfigError(f"FlashHead {v} weights in {root}: missing {'; '.join(missing)}")
    return FlashHeadFiles(v, model, vae, w2v)


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
    codec's ``encode`` / ``decode``: ``cadence.model.flashhead_stream``), by default
    ``cadence.model.ltx_vae.load_ltx_vae``. wav2vec2 runs in float32, as their pipeline runs it."""
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
            try:
                from cadence.model.ltx_vae import load_ltx_vae as ltx_loader
            except ImportError:
                raise ConfigError(
                    "FlashHead lite decodes with the LTX-Video VAE (cadence.model.ltx_vae), not in this build"
                ) from None
        codec = ltx_loader(files.vae, device, dtype)
    return FlashHeadParts(model, codec, features, files)
