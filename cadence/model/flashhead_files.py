"""SoulX-FlashHead's sizes and released folder, torch-free (what the web process resolves a configuration from).

* :class:`FlashHeadConfig`: the DiT's geometry, the transformer's from the model folder's ``config.json``
  (their ``register_to_config`` fields), the audio projection's from the weights' shapes (their code hard-codes
  5 x 12 x 768 -> 512 -> 32 x 1536; a folder with other sizes loads here), checked against each other; the
  safetensors headers are read as JSON, no tensor is loaded. :func:`released_config` is the released geometry
  (random-weight benchmarks).
* :func:`flashhead_files`: the folder a user downloads (``Soul-AILab/SoulX-FlashHead-1_3B`` with
  ``Model_Pro/`` + ``VAE_Wan/Wan2.1_VAE.pth`` or ``Model_Lite/`` + ``VAE_LTX/``, and ``wav2vec2-base-960h``
  beside or inside it), everything missing named in one ``ConfigError``.
* :class:`FlashHeadLayout`: the model families' builder (``cadence.model.families``: ``flashhead-pro`` /
  ``flashhead-lite``): ``configure`` folds the folder's sizes, the VAE beside it and the wav2vec2 folder's
  width into the engine configuration (``CadenceConfig``: every size the engine reads comes from the files,
  so other sizes load too); ``build`` names the torch function that builds the DiT
  (``cadence.model.flashhead.build_for_engine``).

The engine configuration of a FlashHead variant (``engine_overrides``): the Wan block geometry of
``ModelConfig`` (dim, heads, FFN, patch, ``in_channels`` = ``out_channels`` = the VAE's z and
``cond_channels`` = the reference latent's z on the input channels), the audio projection in the 'multitalk'
fields (``audio_window``, ``audio_hidden``, ``audio_tokens_per_frame``, ``audio_context_dim``,
``audio_norm_out``; ``audio_dim`` x ``audio_layers`` = one video frame's wav2vec2 features), the VAE's stride
and z, and ``latent_frames_per_chunk`` = a clip's new frames / the VAE's temporal stride (Pro: 28 / 4 = 7;
Lite: 24 / 8 = 3).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from cadence.config import CadenceConfig, ModelConfig
from cadence.errors import ConfigError, WeightsError

HEADER_LIMIT = 100 * 2**20  # a safetensors header larger than this is not one
LTX_FILES = ("config.json", "diffusion_pytorch_model.safetensors")

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

    def engine_overrides(self, audio_layers: int) -> dict[str, dict]:
        """The ``CadenceConfig`` sections of this geometry (module docstring) with the wav2vec2 features read as
        ``audio_layers`` hidden states per frame."""
        width, rest = divmod(self.audio_frame_width, audio_layers)
        if rest:
            raise ConfigError(
                f"{self.audio_frame_width} audio features per frame are not {audio_layers} wav2vec2 layers"
            )
        model = dict(
            dim=self.dim,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            ffn_dim=self.ffn_dim,
            num_layers=self.num_layers,
            freq_dim=self.freq_dim,
            eps=self.eps,
            patch=self.patch,
            in_channels=self.out_dim,
            out_channels=self.out_dim,
            cond_channels=self.in_dim - self.out_dim,
            rope_theta=self.rope_theta,
            time_embed_fp64=True,
            audio_every=0,
            audio_arch="multitalk",
            audio_dim=width,
            audio_layers=audio_layers,
            audio_window=self.audio_window,
            audio_hidden=self.audio_hidden,
            audio_tokens_per_frame=self.audio_tokens,
            audio_context_dim=self.audio_width,
            audio_norm_out=self.audio_norm,
        )
        return {"model": model, "vae": {"stride": self.vae_stride, "latent_channels": self.out_dim}}

    @classmethod
    def from_engine(cls, cfg: CadenceConfig) -> FlashHeadConfig:
        """The geometry an engine configuration describes (the inverse of :meth:`engine_overrides`)."""
        m = cfg.model
        return cls(
            dim=m.dim,
            num_heads=m.num_heads,
            num_layers=m.num_layers,
            ffn_dim=m.ffn_dim,
            freq_dim=m.freq_dim,
            eps=m.eps,
            in_dim=m.in_channels + m.cond_channels,
            out_dim=m.out_channels,
            patch=tuple(m.patch),
            vae_stride=tuple(cfg.vae.stride),
            audio_window=m.audio_window,
            audio_frame_width=m.audio_dim * m.audio_layers,
            audio_hidden=m.audio_hidden,
            audio_tokens=m.audio_tokens_per_frame,
            audio_width=m.audio_context_dim,
            audio_norm=m.audio_norm_out,
            rope_theta=m.rope_theta,
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
    """Every tensor's shape in the folder's safetensors files, read from their JSON headers (no tensor is read,
    no torch: the web process resolves a configuration from these)."""
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise WeightsError(f"FlashHead model folder {folder}: no .safetensors file")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        shapes.update(safetensors_shapes(f))
    return shapes


def safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """name -> shape from one safetensors file's header (8 bytes little-endian length, then JSON)."""
    try:
        with open(path, "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            if n > HEADER_LIMIT:
                raise ValueError(f"a {n}-byte header")
            header = json.loads(fh.read(n))
        return {k: tuple(int(s) for s in v["shape"]) for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
        raise WeightsError(f"cannot read checkpoint {path}: {type(e).__name__}: {e}") from None


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
    + ``VAE_LTX/`` (config.json + diffusion_pytorch_model.safetensors), and ``wav2vec2`` (else a folder named ``*wav2vec2*`` with a
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
    if v == "lite" and not all((vae / f).is_file() for f in LTX_FILES):
        missing.append(f"{vae_name}/ (the LTX-Video VAE folder, with {' and '.join(LTX_FILES)})")
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


def wav2vec2_sizes(folder: Path) -> tuple[int, int]:
    """(hidden size, hidden layers) of a wav2vec2 folder's config.json."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
        return int(raw["hidden_size"]), int(raw["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"the wav2vec2 folder {folder}: cannot read its config.json ({e})") from None


def ltx_geometry(folder: Path) -> tuple[int, tuple[int, int, int]]:
    """(latent channels, (temporal, spatial, spatial) stride) of an LTX-Video VAE folder's config.json: patch
    size x 2 per spatio-temporal stage in space, 2 per stage in time (``cadence.model.ltx_vae.LTXVAEConfig``)."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
        stages = sum(bool(s) for s in raw["spatio_temporal_scaling"])
        s = int(raw["patch_size"]) * 2**stages
        return int(raw["latent_channels"]), (2**stages, s, s)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"the LTX-Video VAE folder {folder}: cannot read its config.json ({e})") from None


@dataclass(frozen=True)
class FlashHeadLayout:
    """The ``flashhead-pro`` / ``flashhead-lite`` families' model builder (``cadence.model.families.ModelBuilder``):
    the released folder read into the engine configuration, the DiT built by ``build``. Plain data."""

    variant: str
    """'pro' or 'lite'."""
    clip_frames: int = 33
    motion_latents: int = 2
    """Latent frames of motion carried from clip to clip (their ``motion_frames_latent_num``)."""
    about: str = "the released SoulX-FlashHead-1_3B folder"
    """What ``--weights`` takes (``cadence models`` prints it)."""
    build: str = "cadence.model.flashhead:build_for_engine"
    """``"module:function"`` ``(cfg, device, dtype, seed) -> model``: loaded from ``cfg.model.weights``, random
    from ``seed`` without weights."""

    def new_frames(self, vae_scale: int) -> int:
        """A clip's new video frames: ``clip_frames`` less the motion frames (Pro 28, Lite 24)."""
        return self.clip_frames - ((self.motion_latents - 1) * vae_scale + 1)

    def stream_overrides(self, vae_scale: int, where: str) -> dict:
        new = self.new_frames(vae_scale)
        if new <= 0 or new % vae_scale:
            raise ConfigError(
                f"FlashHead {where}: a {self.clip_frames}-frame clip less {self.motion_latents} motion latents "
                f"leaves {new} frames, not whole latent frames of {vae_scale}"
            )
        return {"latent_frames_per_chunk": new // vae_scale}

    def configure(self, cfg: CadenceConfig) -> CadenceConfig:
        """``cfg`` with the released folder at ``cfg.model.weights`` folded in (its sizes, the VAE beside it, the
        wav2vec2 folder's width); without weights ``cfg`` as it is (the registry's released geometry, or a
        test's). One ``ConfigError`` naming what is missing or does not fit. Torch-free."""
        m = cfg.model
        if m.text_encoder:
            raise ConfigError(
                f"{cfg.name} is prompt-free (audio and a reference image drive it): it has no text encoder "
                "for --text-encoder"
            )
        if not m.weights:
            return cfg
        files = flashhead_files(m.weights, self.variant)
        fc = FlashHeadConfig.from_folder(files.model)
        hidden, layers = wav2vec2_sizes(files.wav2vec2)
        if hidden * layers != fc.audio_frame_width:
            raise ConfigError(
                f"the wav2vec2 folder {files.wav2vec2} gives {layers} layers of {hidden} per frame; "
                f"{files.model.name} reads {fc.audio_frame_width} features per frame"
            )
        if self.variant == "lite":
            z, stride = ltx_geometry(files.vae)
            if (z, stride) != (fc.out_dim, fc.vae_stride):
                raise ConfigError(
                    f"the LTX-Video VAE {files.vae} makes {z}-channel latents at stride {stride}; "
                    f"{files.model.name} takes {fc.out_dim} channels at vae_stride {fc.vae_stride}"
                )
        over = fc.engine_overrides(layers)
        over["vae"]["weights"] = cfg.vae.weights or str(files.vae)
        over["stream"] = self.stream_overrides(fc.vae_scale, str(files.model))
        return cfg.with_overrides(**over)
