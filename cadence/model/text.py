"""Prompt embeddings: the real umT5 encoder (through ``transformers``) and the byte-level stand-in.

Contract (both encoders): ``encoder(prompt: str) -> [text_len, text_dim]`` float32, every prompt padded
(or truncated) to the same ``text_len`` tokens, so a new prompt never creates a new step shape.

* :class:`UMT5TextEncoder` is what the Wan family conditions on: umT5-XXL's encoder (512 x 4096), run
  exactly as Wan's ``T5EncoderModel`` / Self-Forcing's ``WanTextEncoder`` run theirs: the prompt cleaned
  (ftfy + HTML unescape + whitespace, Wan's ``clean='whitespace'``), tokenised with the umT5 tokenizer to
  ``text_len`` tokens (padding to max length, truncation, the closing ``</s>``), encoded with the attention
  mask, and every position after the prompt's own tokens set to 0. Weights from a local folder
  (``transformers``' ``UMT5EncoderModel``: config.json + safetensors) or from Wan's original
  ``models_t5_umt5-xxl-enc-bf16.pth`` (Wan's module names, mapped by :func:`wan_t5_to_hf`; the geometry
  is read off the tensors). Embeddings are computed once per prompt and kept in an LRU of
  ``cache_size`` prompts (a live stream that switches back to an earlier prompt does not re-encode).
  ``transformers`` is imported only here, only when a real encoder is built (the GPU machine may not
  have it; CI installs it through the ``test`` extra).
* :class:`ByteTextEncoder` is the deterministic stand-in (UTF-8 bytes -> a fixed seeded table plus a
  sinusoidal position code): the no-download default of the ``character`` and ``tiny`` presets.

:func:`make_text_encoder` picks one from the configuration (``ModelConfig.text_encoder``).
"""

from __future__ import annotations

import html
import logging
import math
import re
from collections import OrderedDict
from pathlib import Path

import torch

from cadence.config import CadenceConfig, ModelConfig
from cadence.errors import ConfigError, WeightsError
from cadence.telemetry.logs import warn_once

log = logging.getLogger(__name__)


class ByteTextEncoder:
    """Deterministic stand-in text encoder (no weights to download)."""

    def __init__(self, cfg: ModelConfig, seed: int = 1234):
        self.len, self.dim = cfg.text_len, cfg.text_dim
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(257, self.dim, generator=g)  # 256 bytes + padding
        pos = torch.arange(self.len, dtype=torch.float32)[:, None]
        div = torch.exp(torch.arange(0, self.dim, 2, dtype=torch.float32) * (-math.log(10_000.0) / self.dim))
        pe = torch.zeros(self.len, self.dim)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)[:, : self.dim // 2]
        self.pos = pe

    def __call__(self, prompt: str) -> torch.Tensor:
        """prompt -> [text_len, text_dim] float32 (CPU)."""
        ids = list(prompt.encode("utf-8"))[: self.len]
        ids = ids + [256] * (self.len - len(ids))
        return self.table[torch.tensor(ids)] + self.pos


# ---- Wan's original umT5 layout -> transformers' UMT5EncoderModel -----------------------------------

_WAN_T5 = [
    (r"token_embedding\.weight", "shared.weight"),
    (r"blocks\.(\d+)\.norm1\.weight", r"encoder.block.\1.layer.0.layer_norm.weight"),
    (r"blocks\.(\d+)\.attn\.(q|k|v|o)\.weight", r"encoder.block.\1.layer.0.SelfAttention.\2.weight"),
    (
        r"blocks\.(\d+)\.pos_embedding\.embedding\.weight",
        r"encoder.block.\1.layer.0.SelfAttention.relative_attention_bias.weight",
    ),
    (r"blocks\.(\d+)\.norm2\.weight", r"encoder.block.\1.layer.1.layer_norm.weight"),
    (r"blocks\.(\d+)\.ffn\.gate\.0\.weight", r"encoder.block.\1.layer.1.DenseReluDense.wi_0.weight"),
    (r"blocks\.(\d+)\.ffn\.fc1\.weight", r"encoder.block.\1.layer.1.DenseReluDense.wi_1.weight"),
    (r"blocks\.(\d+)\.ffn\.fc2\.weight", r"encoder.block.\1.layer.1.DenseReluDense.wo.weight"),
    (r"norm\.weight", "encoder.final_layer_norm.weight"),
]


def wan_t5_config(sd: dict[str, torch.Tensor]) -> dict:
    """``UMT5Config`` arguments read off a Wan umT5 encoder state dict (umT5-XXL: vocab 256384, d_model
    4096, 64 heads of 64, d_ff 10240, 24 layers, 32 buckets; max distance 128 as Wan's code fixes it)."""
    try:
        vocab, d_model = sd["token_embedding.weight"].shape
        buckets, heads = sd["blocks.0.pos_embedding.embedding.weight"].shape
        d_ff = sd["blocks.0.ffn.fc1.weight"].shape[0]
        inner = sd["blocks.0.attn.q.weight"].shape[0]
    except KeyError as e:
        raise WeightsError(f"not a Wan umT5 encoder state dict: no {e.args[0]}") from None
    layers = 1 + max(int(m.group(1)) for k in sd for m in [re.match(r"blocks\.(\d+)\.", k)] if m)
    return dict(
        vocab_size=int(vocab),
        d_model=int(d_model),
        d_kv=int(inner // heads),
        d_ff=int(d_ff),
        num_layers=int(layers),
        num_heads=int(heads),
        relative_attention_num_buckets=int(buckets),
        relative_attention_max_distance=128,
        feed_forward_proj="gated-gelu",
        layer_norm_epsilon=1e-6,
        dropout_rate=0.0,
        is_encoder_decoder=False,
        use_cache=False,
        tie_word_embeddings=False,
    )


def wan_t5_to_hf(sd: dict[str, torch.Tensor], source: str = "state dict") -> dict[str, torch.Tensor]:
    """Wan's ``T5Encoder`` names -> ``UMT5EncoderModel`` names (the embedding also as
    ``encoder.embed_tokens``); unmatched keys raise :class:`WeightsError` listing them."""
    rules = [(re.compile(p + "$"), t) for p, t in _WAN_T5]
    out, bad = {}, []
    for k, v in sd.items():
        for rx, tpl in rules:
            m = rx.match(k)
            if m:
                out[m.expand(tpl)] = v
                break
        else:
            bad.append(k)
    if bad:
        raise WeightsError(
            f"{source}: {len(bad)} key(s) that are not Wan umT5 encoder weights: {', '.join(bad[:6])}"
        )
    if "shared.weight" in out:
        out["encoder.embed_tokens.weight"] = out["shared.weight"]
    return out


def _fix_text(text: str) -> str:
    try:
        import ftfy
    except ImportError:  # ftfy only repairs mojibake; plain prompts are unchanged by it
        warn_once(
            log,
            "ftfy",
            "ftfy is not installed: prompts are not passed through ftfy.fix_text (Wan's cleaning)",
        )
        return text
    return ftfy.fix_text(text)


def clean_prompt(text: str) -> str:
    """Wan's ``clean='whitespace'``: ftfy.fix_text, HTML-unescape twice, strip, collapse whitespace."""
    text = html.unescape(html.unescape(_fix_text(text))).strip()
    return re.sub(r"\s+", " ", text).strip()


class UMT5TextEncoder:
    """umT5 encoder + tokenizer from local files, run as Wan runs it; embeddings cached per prompt."""

    def __init__(
        self,
        weights: str | Path,
        tokenizer: str | Path | None = None,
        text_len: int = 512,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        cache_size: int = 16,
    ):
        try:
            from transformers import AutoTokenizer, UMT5Config, UMT5EncoderModel
        except ImportError:
            raise ConfigError(
                "the umT5 text encoder needs the 'transformers' package (pip install transformers "
                "sentencepiece), or leave ModelConfig.text_encoder unset for the stand-in"
            ) from None
        weights = Path(weights)
        tok_dir = Path(tokenizer) if tokenizer is not None else (weights if weights.is_dir() else None)
        if tok_dir is None or not tok_dir.is_dir():
            raise ConfigError(
                f"umT5 tokenizer folder not found: {tok_dir} (set ModelConfig.text_tokenizer: Wan "
                "ships it as google/umt5-xxl/)"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
        if weights.is_dir():
            if not (weights / "config.json").is_file():
                raise WeightsError(f"umT5 encoder folder {weights} has no config.json")
            model = UMT5EncoderModel.from_pretrained(str(weights), dtype=dtype)
        elif weights.is_file():
            try:
                sd = torch.load(str(weights), map_location="cpu", weights_only=True, mmap=True)
            except Exception as e:
                raise WeightsError(f"cannot read umT5 encoder {weights}: {e}") from None
            cfg = UMT5Config(**wan_t5_config(sd))
            with torch.device("meta"):
                model = UMT5EncoderModel(cfg)
            hf = wan_t5_to_hf(sd, source=str(weights))
            missing, unexpected = model.load_state_dict(hf, strict=False, assign=True)
            missing = [k for k in missing if k != "encoder.embed_tokens.weight"]
            if missing or unexpected:
                raise WeightsError(
                    f"umT5 encoder {weights}: missing {missing[:6]}, unexpected {unexpected[:6]}"
                )
            model.encoder.embed_tokens = model.shared
        else:
            raise WeightsError(f"umT5 encoder weights not found: {weights}")
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.len, self.dim = text_len, model.config.d_model
        self.device = torch.device(device)
        self.cache_size = cache_size
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encoded = 0  # prompts actually run through the encoder (cache misses)

    def tokenize(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, mask) [B, text_len] as Wan's HuggingfaceTokenizer(seq_len=text_len, clean='whitespace')."""
        out = self.tokenizer(
            [clean_prompt(p) for p in prompts],
            return_tensors="pt",
            padding="max_length",
            truncation=True,
            max_length=self.len,
            add_special_tokens=True,
        )
        return out.input_ids, out.attention_mask

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> torch.Tensor:
        """[B, text_len, d_model] float32 on the encoder's device, zero after each prompt's tokens."""
        ids, mask = self.tokenize(prompts)
        ids, mask = ids.to(self.device), mask.to(self.device)
        h = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        return h * mask[..., None].to(h.dtype)

    def __call__(self, prompt: str) -> torch.Tensor:
        """prompt -> [text_len, d_model] float32 on the encoder's device (cached, LRU)."""
        hit = self._cache.get(prompt)
        if hit is not None:
            self._cache.move_to_end(prompt)
            return hit
        emb = self.encode([prompt])[0]
        self.encoded += 1
        self._cache[prompt] = emb
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return emb


def make_text_encoder(
    cfg: CadenceConfig | ModelConfig, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
):
    """The configured prompt encoder: :class:`UMT5TextEncoder` when ``ModelConfig.text_encoder`` names
    weights, else the :class:`ByteTextEncoder` stand-in (the no-download default; for a model family this
    means random conditioning, so it is logged). Either returns [text_len, text_dim] per prompt."""
    m = cfg.model if isinstance(cfg, CadenceConfig) else cfg
    if not m.text_encoder:
        if m.family:
            warn_once(
                log,
                f"standin-{m.family}",
                f"model family {m.family!r} without a text encoder: prompts go through the byte-level "
                "stand-in (set --text-encoder to the umT5 folder or Wan's .pth)",
            )
        return ByteTextEncoder(m)
    enc = UMT5TextEncoder(m.text_encoder, m.text_tokenizer, text_len=m.text_len, device=device, dtype=dtype)
    if enc.dim != m.text_dim:
        raise ConfigError(
            f"text encoder {m.text_encoder} gives {enc.dim}-wide embeddings; the model takes "
            f"text_dim {m.text_dim}"
        )
    return enc
