"""Checkpoint key maps: diffusers' and Wan's original parameter names -> Cadence's (weights loading and
LoRA merging both read them; a module of their own so neither imports the other).

Each rule: (regex on a source key, cadence key template, slot in a fused group or None).
"""

from __future__ import annotations

_FUSED = {"qkv": ("q", "k", "v"), "kv": ("k", "v"), "kv_img": ("k", "v")}

_DIFFUSERS: list[tuple[str, str, str | None]] = [
    (r"patch_embedding\.(weight|bias)", r"patch_embed.\1", None),
    (r"condition_embedder\.time_embedder\.linear_1\.(\w+)", r"time_embed.fc1.\1", None),
    (r"condition_embedder\.time_embedder\.linear_2\.(\w+)", r"time_embed.fc2.\1", None),
    (r"condition_embedder\.time_proj\.(\w+)", r"time_proj.\1", None),
    (r"condition_embedder\.text_embedder\.linear_1\.(\w+)", r"text_embed.fc1.\1", None),
    (r"condition_embedder\.text_embedder\.linear_2\.(\w+)", r"text_embed.fc2.\1", None),
    (r"blocks\.(\d+)\.attn1\.to_q\.(\w+)", r"blocks.\1.self_attn.qkv.\2", "q"),
    (r"blocks\.(\d+)\.attn1\.to_k\.(\w+)", r"blocks.\1.self_attn.qkv.\2", "k"),
    (r"blocks\.(\d+)\.attn1\.to_v\.(\w+)", r"blocks.\1.self_attn.qkv.\2", "v"),
    (r"blocks\.(\d+)\.attn1\.to_out\.0\.(\w+)", r"blocks.\1.self_attn.out.\2", None),
    (r"blocks\.(\d+)\.attn1\.norm_(q|k)\.weight", r"blocks.\1.self_attn.norm_\2.weight", None),
    (r"blocks\.(\d+)\.attn2\.to_q\.(\w+)", r"blocks.\1.cross_attn.q.\2", None),
    (r"blocks\.(\d+)\.attn2\.to_k\.(\w+)", r"blocks.\1.cross_attn.kv.\2", "k"),
    (r"blocks\.(\d+)\.attn2\.to_v\.(\w+)", r"blocks.\1.cross_attn.kv.\2", "v"),
    (r"blocks\.(\d+)\.attn2\.to_out\.0\.(\w+)", r"blocks.\1.cross_attn.out.\2", None),
    (r"blocks\.(\d+)\.attn2\.norm_(q|k)\.weight", r"blocks.\1.cross_attn.norm_\2.weight", None),
    (r"blocks\.(\d+)\.norm2\.(weight|bias)", r"blocks.\1.norm2.\2", None),
    (r"blocks\.(\d+)\.ffn\.net\.0\.proj\.(\w+)", r"blocks.\1.ffn.fc1.\2", None),
    (r"blocks\.(\d+)\.ffn\.net\.2\.(\w+)", r"blocks.\1.ffn.fc2.\2", None),
    (r"blocks\.(\d+)\.scale_shift_table", r"blocks.\1.modulation", None),
    (r"proj_out\.(\w+)", r"head.proj.\1", None),
    (r"scale_shift_table", r"head.modulation", None),
]

# The original Wan checkpoints (Wan-Video/Wan2.1 `wan/modules/model.py`). Note the swapped norm
# names: Wan's `norm3` is the affine norm before cross-attention (Cadence/diffusers `norm2`).
_WAN: list[tuple[str, str, str | None]] = [
    (r"patch_embedding\.(weight|bias)", r"patch_embed.\1", None),
    (r"time_embedding\.0\.(\w+)", r"time_embed.fc1.\1", None),
    (r"time_embedding\.2\.(\w+)", r"time_embed.fc2.\1", None),
    (r"time_projection\.1\.(\w+)", r"time_proj.\1", None),
    (r"text_embedding\.0\.(\w+)", r"text_embed.fc1.\1", None),
    (r"text_embedding\.2\.(\w+)", r"text_embed.fc2.\1", None),
    (r"blocks\.(\d+)\.self_attn\.(q|k|v)\.(\w+)", r"blocks.\1.self_attn.qkv.\3", "\\2"),
    (r"blocks\.(\d+)\.self_attn\.o\.(\w+)", r"blocks.\1.self_attn.out.\2", None),
    (r"blocks\.(\d+)\.self_attn\.norm_(q|k)\.weight", r"blocks.\1.self_attn.norm_\2.weight", None),
    (r"blocks\.(\d+)\.cross_attn\.q\.(\w+)", r"blocks.\1.cross_attn.q.\2", None),
    (r"blocks\.(\d+)\.cross_attn\.(k|v)\.(\w+)", r"blocks.\1.cross_attn.kv.\3", "\\2"),
    (r"blocks\.(\d+)\.cross_attn\.o\.(\w+)", r"blocks.\1.cross_attn.out.\2", None),
    (r"blocks\.(\d+)\.cross_attn\.norm_(q|k)\.weight", r"blocks.\1.cross_attn.norm_\2.weight", None),
    (r"blocks\.(\d+)\.norm3\.(weight|bias)", r"blocks.\1.norm2.\2", None),
    (r"blocks\.(\d+)\.ffn\.0\.(\w+)", r"blocks.\1.ffn.fc1.\2", None),
    (r"blocks\.(\d+)\.ffn\.2\.(\w+)", r"blocks.\1.ffn.fc2.\2", None),
    (r"blocks\.(\d+)\.modulation", r"blocks.\1.modulation", None),
    (r"head\.head\.(\w+)", r"head.proj.\1", None),
    (r"head\.modulation", r"head.modulation", None),
    # Wan2.1-I2V: CLIP image tokens (``img_emb``: LayerNorm, Linear, GELU, Linear, LayerNorm) and their K/V
    # in every block's cross-attention
    (r"img_emb\.proj\.0\.(weight|bias)", r"img_emb.norm_in.\1", None),
    (r"img_emb\.proj\.1\.(weight|bias)", r"img_emb.fc1.\1", None),
    (r"img_emb\.proj\.3\.(weight|bias)", r"img_emb.fc2.\1", None),
    (r"img_emb\.proj\.4\.(weight|bias)", r"img_emb.norm_out.\1", None),
    (r"blocks\.(\d+)\.cross_attn\.(k|v)_img\.(\w+)", r"blocks.\1.cross_attn.kv_img.\3", "\\2"),
    (r"blocks\.(\d+)\.cross_attn\.norm_k_img\.weight", r"blocks.\1.cross_attn.norm_k_img.weight", None),
    # InfiniteTalk / SoulX-FlashTalk (``cadence.model.multitalk``): the audio projection and every block's
    # audio cross-attention (``kv_linear`` is already k then v) and its input norm
    (r"audio_proj\.(proj1|proj1_vf|proj2|proj3|norm)\.(weight|bias)", r"audio_proj.\1.\2", None),
    (r"blocks\.(\d+)\.audio_cross_attn\.q_linear\.(\w+)", r"blocks.\1.audio_attn.q.\2", None),
    (r"blocks\.(\d+)\.audio_cross_attn\.kv_linear\.(\w+)", r"blocks.\1.audio_attn.kv.\2", None),
    (r"blocks\.(\d+)\.audio_cross_attn\.proj\.(\w+)", r"blocks.\1.audio_attn.out.\2", None),
    (r"blocks\.(\d+)\.norm_x\.(weight|bias)", r"blocks.\1.norm_audio.\2", None),
]

KEY_MAPS: dict[str, list[tuple[str, str, str | None]]] = {"diffusers": _DIFFUSERS, "wan": _WAN}
