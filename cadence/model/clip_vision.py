"""CLIP image tokens for Wan I2V families (SoulX-FlashTalk / InfiniteTalk's ``clip_fea``), through ``transformers``.

The file is Wan's own: ``models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth``, the whole ``XLMRobertaCLIP``
state dict of ``wan/modules/clip.py`` (vision tower ``visual.*``, text tower ``textual.*``, ``log_scale``). Its
vision tower is a ViT-H/14 that ``transformers``' ``CLIPVisionModel`` computes exactly: patch conv without bias,
a class token, learned positions, a LayerNorm before the blocks (``pre_norm``), pre-norm blocks with one fused
``to_qkv`` (split here into q / k / v), exact GELU MLPs (``activation='gelu'``), LayerNorms eps 1e-5, softmax
scale head_dim^-1/2. :func:`clip_vision_keymap` maps its keys; nothing of the text tower is read.

What the family feeds its model (``CLIPModel.visual``): the reference image in [-1, 1], resized to the tower's
224 x 224 by bicubic interpolation (``align_corners=False``, no antialias), moved to [0, 1] (x 0.5 + 0.5) and
normalised with CLIP's mean / std; the tokens after all blocks but the last (``use_31_block``: 31 of 32, no
final LayerNorm): [B, 257, 1280]. The model here is built with ``layers - 1`` blocks, so the last block (and
the head) is never run; its keys are checked and dropped.

Geometry is read off the tensors (width, patch, image size, depth, MLP width); the head count is not in them:
``heads`` (ViT-H/14: 16, 80 wide each, the default for a 1280-wide tower).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F

from cadence.errors import WeightsError

MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)

_BLOCK = re.compile(r"transformer\.(\d+)\.(.+)")
_BLOCK_MAP = {
    "norm1.weight": "layer_norm1.weight",
    "norm1.bias": "layer_norm1.bias",
    "attn.proj.weight": "self_attn.out_proj.weight",
    "attn.proj.bias": "self_attn.out_proj.bias",
    "norm2.weight": "layer_norm2.weight",
    "norm2.bias": "layer_norm2.bias",
    "mlp.0.weight": "mlp.fc1.weight",
    "mlp.0.bias": "mlp.fc1.bias",
    "mlp.2.weight": "mlp.fc2.weight",
    "mlp.2.bias": "mlp.fc2.bias",
}
_TOP_MAP = {
    "patch_embedding.weight": "embeddings.patch_embedding.weight",
    "pos_embedding": "embeddings.position_embedding.weight",
    "cls_embedding": "embeddings.class_embedding",
    "pre_norm.weight": "pre_layrnorm.weight",
    "pre_norm.bias": "pre_layrnorm.bias",
    "post_norm.weight": "post_layernorm.weight",
    "post_norm.bias": "post_layernorm.bias",
}
_UNUSED_TOP = {"head"}  # the image projection of the contrastive head: not part of the tokens


def _vision_part(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if any(k.startswith("visual.") for k in sd):
        return {k[len("visual.") :]: v for k, v in sd.items() if k.startswith("visual.")}
    return dict(sd)  # a vision tower saved on its own


def clip_vision_keymap(
    sd: dict[str, torch.Tensor], source: str = "<state dict>", heads: int | None = None
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Wan's ``XLMRobertaCLIP`` state dict -> (``CLIPVisionConfig`` kwargs, the ``CLIPVisionModel`` state dict of
    its first ``layers - 1`` blocks, names as in its vision transformer). Raises :class:`WeightsError` naming ``source`` for a file that is not such a
    tower (missing, unexpected or mis-shaped keys)."""
    vis = _vision_part(sd)
    config, dim, layers = _tower_config(vis, source, heads)
    return config, _renamed(vis, source, dim, layers)


def _tower_config(vis: dict, source: str, heads: int | None) -> tuple[dict, int, int]:
    """The ``CLIPVisionConfig`` kwargs of the tower (its width, patch, grid, blocks, heads), the width and the
    block count; one ``WeightsError`` for a file that is not such a tower."""
    need = ("patch_embedding.weight", "pos_embedding", "cls_embedding", "pre_norm.weight")
    missing = [k for k in need if k not in vis]
    if missing:
        raise WeightsError(
            f"{source}: not a Wan CLIP checkpoint (open-clip XLM-RoBERTa ViT): missing key(s) "
            f"{', '.join('visual.' + k for k in missing)}"
        )
    patch = vis["patch_embedding.weight"]
    if patch.ndim != 4 or patch.shape[1] != 3 or patch.shape[2] != patch.shape[3]:
        raise WeightsError(f"{source}: visual.patch_embedding.weight has shape {tuple(patch.shape)}")
    dim, p = patch.shape[0], patch.shape[2]
    positions = vis["pos_embedding"].shape[-2]
    grid = math.isqrt(positions - 1)
    if grid * grid != positions - 1:
        raise WeightsError(f"{source}: visual.pos_embedding holds {positions} positions (not 1 + a square)")
    layers = 1 + max((int(m.group(1)) for k in vis if (m := _BLOCK.fullmatch(k))), default=-1)
    if layers < 2:
        raise WeightsError(f"{source}: {layers} vision block(s); the tokens need the second-to-last of >= 2")
    if heads is None:
        if dim % 80:
            raise WeightsError(f"{source}: a {dim}-wide tower: pass heads= (80-wide heads assumed otherwise)")
        heads = dim // 80
    mlp = vis.get("transformer.0.mlp.0.weight")
    if mlp is None:
        raise WeightsError(f"{source}: missing key visual.transformer.0.mlp.0.weight")
    config = dict(
        hidden_size=dim,
        intermediate_size=mlp.shape[0],
        num_hidden_layers=layers - 1,
        num_attention_heads=heads,
        image_size=grid * p,
        patch_size=p,
        num_channels=3,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
        attention_dropout=0.0,
    )
    return config, dim, layers


def _renamed(vis: dict, source: str, dim: int, layers: int) -> dict[str, torch.Tensor]:
    """The tower's tensors under ``CLIPVisionModel``'s names (the fused qkv split, the last block left out);
    one ``WeightsError`` listing unexpected keys or a mis-shaped qkv."""
    out: dict[str, torch.Tensor] = {}
    unexpected = []
    for k, v in vis.items():
        if k in _TOP_MAP:
            v = (
                v.reshape(-1)
                if k == "cls_embedding"
                else v.reshape(v.shape[-2:])
                if k == "pos_embedding"
                else v
            )
            out[_TOP_MAP[k]] = v
        elif k in _UNUSED_TOP:
            continue
        elif m := _BLOCK.fullmatch(k):
            i, rest = int(m.group(1)), m.group(2)
            if i == layers - 1:
                continue  # the last block: FlashTalk stops before it
            pre = f"encoder.layers.{i}."
            if rest in ("attn.to_qkv.weight", "attn.to_qkv.bias"):
                kind = rest.rsplit(".", 1)[1]
                if v.shape[0] != 3 * dim:
                    raise WeightsError(
                        f"{source}: visual.{k} has shape {tuple(v.shape)}, expected 3 x {dim} rows"
                    )
                for name, part in zip(("q_proj", "k_proj", "v_proj"), v.chunk(3, dim=0)):
                    out[f"{pre}self_attn.{name}.{kind}"] = part
            elif rest in _BLOCK_MAP:
                out[pre + _BLOCK_MAP[rest]] = v
            else:
                unexpected.append("visual." + k)
        else:
            unexpected.append("visual." + k)
    if unexpected:
        raise WeightsError(
            f"{source}: unexpected key(s) for a Wan CLIP vision tower: {', '.join(unexpected[:8])}"
        )
    return out


class ClipVision:
    """Wan's CLIP vision tower in a ``transformers`` ``CLIPVisionModel``: ``encode(image)`` -> FlashTalk's
    ``clip_fea``."""

    def __init__(self, model, device="cpu", dtype=torch.float32):
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.image_size = model.config.image_size
        self.device, self.dtype = torch.device(device), dtype

    def preprocess(self, image: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] in [-1, 1] -> [B, 3, S, S], as ``CLIPModel.visual``: bicubic resize, x 0.5 + 0.5,
        (x - mean) / std."""
        s = self.image_size
        x = F.interpolate(image, size=(s, s), mode="bicubic", align_corners=False)
        x = x * 0.5 + 0.5
        mean = torch.tensor(MEAN, device=x.device, dtype=x.dtype)[:, None, None]
        std = torch.tensor(STD, device=x.device, dtype=x.dtype)[:, None, None]
        return (x - mean) / std

    @torch.no_grad()
    def encode(self, image: torch.Tensor) -> torch.Tensor:
        """The reference image(s) [B, 3, H, W] (or Cadence's [3, 1, H, W]) in [-1, 1] -> [B, 257, width]: the
        tokens after all blocks but the last."""
        if image.ndim == 4 and image.shape[1] == 1 and image.shape[0] == 3:
            image = image.transpose(0, 1)  # [3, 1, H, W] -> [1, 3, H, W]
        x = self.preprocess(image.to(self.device, self.dtype))
        return self.model(pixel_values=x).last_hidden_state


def load_clip_vision(
    path, heads: int | None = None, device="cpu", dtype=torch.float32, attn_implementation: str = "sdpa"
) -> ClipVision:
    """Wan's CLIP ``.pth`` (``models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth``) -> :class:`ClipVision`.
    The file is memory-mapped: the text tower is never read into memory."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"{path}: no such CLIP checkpoint file")
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file is one clear error
        raise WeightsError(f"{path}: not a torch state dict ({type(e).__name__}: {e})") from None
    if not isinstance(sd, dict):
        raise WeightsError(f"{path}: holds a {type(sd).__name__}, not a state dict")
    config, state = clip_vision_keymap(sd, str(path), heads)
    cfg = CLIPVisionConfig(**config)
    cfg._attn_implementation = attn_implementation
    with torch.device("meta"):
        model = CLIPVisionModel(cfg)
    tower = getattr(model, "vision_model", model)  # transformers 4 nests the tower; 5 does not
    tower.load_state_dict(state, strict=True, assign=True)
    emb = tower.embeddings
    if getattr(emb, "position_ids", None) is not None and emb.position_ids.is_meta:  # a non-persistent buffer
        emb.register_buffer("position_ids", torch.arange(emb.num_positions)[None], persistent=False)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise WeightsError(f"{path}: nothing loaded into {', '.join(left[:4])}")
    return ClipVision(model.float() if dtype == torch.float32 else model, device=device, dtype=dtype)
