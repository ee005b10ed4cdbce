"""The umT5 prompt encoder against Wan's own T5 code (fixture: tests/fixtures/umt5, made by
scripts/fixtures/make_umt5.py), the prompt cache, and the encoder factories.

Error measure: ||cadence - reference|| / ||reference|| over the embeddings (float32, CPU); tolerance
1e-5 (the same float32 math in another module layout: differences are summation order only).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cadence.config import get_preset
from cadence.errors import WeightsError
from cadence.model.families import family_config
from cadence.model.text import ByteTextEncoder, clean_prompt, make_text_encoder, wan_t5_to_hf

pytest.importorskip("transformers")

FIX = Path(__file__).parent / "fixtures" / "umt5"
PTH = FIX / "models_t5_tiny-enc.pth"
TOK = FIX / "tokenizer"
DATA = torch.load(FIX / "data.pt", weights_only=True)
SEQ = DATA["ids"].shape[1]


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def encoder(weights=PTH, **kw):
    from cadence.model.text import UMT5TextEncoder

    return UMT5TextEncoder(weights, TOK, text_len=SEQ, **kw)


def test_tokenizer_matches_wan_tokenizer():
    ids, mask = encoder().tokenize(DATA["prompts"])
    assert torch.equal(ids, DATA["ids"]) and torch.equal(mask, DATA["mask"])


def test_wan_pth_embeddings_match_reference():
    enc = encoder()
    got = enc.encode(DATA["prompts"])
    assert got.shape == DATA["embeds"].shape
    err = rel(got, DATA["embeds"])
    assert err <= 1e-5, err
    # padding positions are exactly zero, as Wan's wrapper leaves them
    assert torch.all(got[DATA["mask"] == 0] == 0)


def test_transformers_folder_embeddings_match_reference(tmp_path):
    """The same weights as a transformers UMT5EncoderModel folder (config.json + safetensors)."""
    from transformers import UMT5Config, UMT5EncoderModel

    from cadence.model.text import wan_t5_config

    sd = torch.load(PTH, weights_only=True)
    model = UMT5EncoderModel(UMT5Config(**wan_t5_config(sd)))
    model.load_state_dict(wan_t5_to_hf(sd))
    model.save_pretrained(tmp_path / "umt5")
    got = encoder(tmp_path / "umt5").encode(DATA["prompts"])
    err = rel(got, DATA["embeds"])
    assert err <= 1e-5, err


def test_prompt_cache_is_lru_and_returns_the_same_embedding():
    enc = encoder(cache_size=2)
    a = enc(DATA["prompts"][0])
    assert torch.equal(a, DATA["embeds"][0]) or rel(a, DATA["embeds"][0]) <= 1e-5
    assert enc(DATA["prompts"][0]) is a and enc.encoded == 1
    enc(DATA["prompts"][1])
    enc(DATA["prompts"][2])  # evicts prompt 0 (least recently used)
    enc(DATA["prompts"][1])
    assert enc.encoded == 3
    enc(DATA["prompts"][0])
    assert enc.encoded == 4
    # every prompt has the same fixed shape (no new step shape per prompt)
    assert {tuple(enc(p).shape) for p in DATA["prompts"]} == {(SEQ, 32)}


def test_wan_cleaning():
    assert clean_prompt("  a &amp;amp; b \n\t c ") == "a & b c"


def test_bad_umt5_state_dict_is_named(tmp_path):
    sd = torch.load(PTH, weights_only=True)
    sd["blocks.0.extra.weight"] = torch.zeros(2)
    with pytest.raises(WeightsError, match=r"not Wan umT5 encoder weights: blocks\.0\.extra\.weight"):
        wan_t5_to_hf(sd, "x.pth")


def test_factory_stand_in_and_real():
    assert isinstance(make_text_encoder(get_preset("tiny")), ByteTextEncoder)
    assert isinstance(make_text_encoder(get_preset("character")), ByteTextEncoder)
    cfg = family_config(
        "self-forcing", text_encoder=str(PTH), text_tokenizer=str(TOK), model=dict(text_dim=32, text_len=SEQ)
    )
    enc = make_text_encoder(cfg)
    assert rel(enc(DATA["prompts"][2]), DATA["embeds"][2]) <= 1e-5
    bad = family_config("self-forcing", text_encoder=str(PTH), text_tokenizer=str(TOK))  # text_dim 4096
    with pytest.raises(Exception, match=r"gives 32-wide embeddings; the model takes text_dim 4096"):
        make_text_encoder(bad)


def test_the_presets_and_text_families_declare_the_log_mel_stand_in():
    from cadence.engine.recipe import session_rules
    from cadence.model.audio import AudioFeatures
    from cadence.model.encoders import build_front_ends
    from cadence.model.families import LogMelAudio, VaeSinkImage

    cfg = get_preset("character")
    rules = session_rules(cfg)
    assert isinstance(rules.audio, LogMelAudio) and isinstance(rules.image, VaeSinkImage)
    image, enc = build_front_ends(cfg, (rules.image, rules.audio), "cpu", torch.float32)
    assert image is None and isinstance(enc, AudioFeatures)
    out = enc(torch.zeros(cfg.audio_samples_per_chunk))
    assert tuple(out.shape) == (1, cfg.model.audio_tokens_per_frame, cfg.model.audio_dim)
    assert isinstance(session_rules(family_config("self-forcing")).audio, LogMelAudio)
