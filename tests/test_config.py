"""Presets carry the docs/workloads.md shapes; invalid configurations fail with messages naming the numbers."""

from __future__ import annotations

import pytest

from cadence.config import AUDIO_SAMPLE_RATE, PRESETS, CadenceConfig, ModelConfig, get_preset
from cadence.errors import ConfigError


def test_presets_exist():
    assert {"tiny", "w1.3", "w14", "w57"} <= set(PRESETS)
    for name in ("tiny", "w1.3", "w14", "w57"):
        assert get_preset(name).name == name
    # names are case-insensitive
    assert get_preset("W57") is get_preset("w57")


def test_w57_shapes():
    c = get_preset("w57")
    m = c.model
    assert (m.dim, m.num_heads, m.head_dim, m.ffn_dim, m.num_layers) == (8192, 64, 128, 24576, 60)
    assert m.patch == (1, 2, 2)
    assert c.vae.stride == (4, 16, 16) and c.vae.latent_channels == 48
    assert m.in_channels == m.out_channels == 48
    assert (c.stream.height, c.stream.width) == (704, 1088)
    assert c.latent_hw == (44, 68)
    assert c.token_grid == (22, 34)
    assert c.tokens_per_chunk == 748
    assert c.stream.window_chunks == 20 and c.stream.sink_frames == 1
    assert c.sink_tokens == 748
    # (1 sink + 20 window) x 748 keys for 748 queries
    assert c.kv_tokens == 15708
    assert c.stream.passes == 4
    # 60 layers x 4 passes = 240 attention calls per step (docs/workloads.md)
    assert m.num_layers * c.stream.passes == 240
    # 4 video frames per chunk at 24 fps = 166.7 ms = 8000 samples at 48 kHz
    assert c.video_frames_per_chunk == 4
    assert c.audio_samples_per_chunk == 8000
    assert c.chunk_seconds == pytest.approx(4 / 24)
    assert m.text_len == 512 and m.text_dim == 4096
    assert c.shape_summary()["kv_tokens"] == 15708


def test_w14_shapes():
    c = get_preset("w14")
    m = c.model
    assert (m.dim, m.num_heads, m.head_dim, m.ffn_dim, m.num_layers) == (5120, 40, 128, 13824, 40)
    assert c.vae.stride == (4, 16, 16) and c.vae.latent_channels == 48
    # same chunk geometry as W57
    assert c.tokens_per_chunk == 748 and c.kv_tokens == 15708
    assert c.stream.window_chunks == 20 and c.stream.sink_frames == 1


def test_w13_shapes():
    c = get_preset("w1.3")
    m = c.model
    assert (m.dim, m.num_heads, m.head_dim, m.ffn_dim, m.num_layers) == (1536, 12, 128, 8960, 30)
    assert c.vae.stride == (4, 8, 8) and c.vae.latent_channels == 16
    assert (c.stream.height, c.stream.width) == (480, 832)
    assert c.token_grid == (30, 52)
    assert c.tokens_per_frame == 1560
    assert c.stream.latent_frames_per_chunk == 3
    assert c.tokens_per_chunk == 4680
    assert c.video_frames_per_chunk == 12
    assert c.audio_samples_per_chunk == 12 * AUDIO_SAMPLE_RATE // 24
    # "up to 21 latent frames" visible: sink + window x frames per chunk
    visible = c.stream.sink_frames + c.stream.window_chunks * c.stream.latent_frames_per_chunk
    assert visible <= 21
    assert c.kv_tokens == visible * 1560


def test_tiny_is_small():
    c = get_preset("tiny")
    m = c.model
    assert m.dim <= 128 and m.num_layers <= 3
    assert c.tokens_per_chunk == 64  # 128x128 video, stride 8, patch 2 -> 8x8 tokens
    assert c.audio_samples_per_chunk == 8000
    # the tiny preset must be able to slide its window in a short test
    assert c.stream.window_chunks < 6


@pytest.mark.parametrize("name", ["tiny", "w1.3", "w14", "w57"])
def test_rope_split_matches_wan(name):
    m = get_preset(name).model
    split = m.rope_split
    assert sum(split) == m.head_dim and all(s % 2 == 0 and s > 0 for s in split)
    if m.head_dim == 128:
        assert split == (44, 42, 42)


def _err(**sections) -> str:
    with pytest.raises(ConfigError) as ei:
        get_preset("tiny").with_overrides(**sections)
    return str(ei.value)


def test_height_not_divisible():
    msg = _err(stream={"height": 120})
    # 120 is not divisible by 8 x 2 = 16
    assert "height 120" in msg and "16" in msg


def test_width_not_divisible():
    msg = _err(stream={"width": 100})
    assert "width 100" in msg and "16" in msg


def test_heads_times_head_dim():
    msg = _err(model={"num_heads": 3})
    assert "3" in msg and "32" in msg and "96" in msg and "128" in msg


def test_timesteps_vs_passes():
    msg = _err(stream={"passes": 3})
    assert "passes (3)" in msg and "(4)" in msg
    msg = _err(stream={"passes": 2, "timesteps": (1000.0, 500.0, 250.0)})
    assert "passes (2)" in msg and "(3)" in msg


def test_timesteps_must_decrease():
    msg = _err(stream={"timesteps": (250.0, 500.0, 750.0, 1000.0)})
    assert "250.0" in msg and "decreasing" in msg
    _err(stream={"timesteps": (1000.0, 750.0, 500.0, 0.0)})  # 0 is not in (0, 1000]


def test_unknown_sampler():
    msg = _err(stream={"sampler": "ddim"})
    assert "'ddim'" in msg


def test_unknown_commit_and_cache():
    assert "'sometimes'" in _err(stream={"commit": "sometimes"})
    assert "'ring9'" in _err(stream={"cache": "ring9"})


def test_bad_window():
    msg = _err(stream={"window_chunks": 0})
    assert "window_chunks" in msg and "0" in msg
    msg = _err(stream={"window_chunks": -3})
    assert "-3" in msg


def test_channels_must_match_vae():
    msg = _err(model={"in_channels": 48, "out_channels": 48})
    assert "48" in msg and "16" in msg


def test_head_dim_rope():
    msg = _err(model={"num_heads": 32, "head_dim": 4})
    assert "head_dim (4)" in msg


def test_fps_must_give_whole_samples():
    msg = _err(stream={"fps": 7})  # 4 * 48000 / 7 is not whole
    assert "fps 7" in msg


def test_all_problems_listed_at_once():
    msg = _err(stream={"height": 120, "sampler": "ddim"})
    assert "height 120" in msg and "'ddim'" in msg


def test_direct_construction_validates():
    with pytest.raises(ConfigError, match="num_heads"):
        CadenceConfig(model=ModelConfig(dim=100, num_heads=4, head_dim=32))


def test_unknown_preset():
    with pytest.raises(ConfigError) as ei:
        get_preset("w999")
    msg = str(ei.value)
    assert "w999" in msg and "w57" in msg and "tiny" in msg


def test_with_overrides_unknown_field():
    with pytest.raises(ConfigError) as ei:
        get_preset("tiny").with_overrides(model={"num_layerz": 3})
    assert "num_layerz" in str(ei.value) and "num_layers" in str(ei.value)


def test_with_overrides_applies_and_keeps_rest():
    base = get_preset("tiny")
    c = base.with_overrides(model={"num_layers": 3}, stream={"window_chunks": 2}, name="t2")
    assert c.model.num_layers == 3 and c.stream.window_chunks == 2 and c.name == "t2"
    assert c.model.dim == base.model.dim and c.stream.height == base.stream.height
    # the preset itself is untouched (frozen dataclasses)
    assert base.model.num_layers == 2 and base.stream.window_chunks == 4


def test_config_error_is_value_error():
    # callers that catch ValueError (argparse, HTTP handlers) still see it
    with pytest.raises(ValueError):
        get_preset("tiny").with_overrides(stream={"window_chunks": 0})


def test_with_overrides_unknown_section():
    # a typo in the section name must be a ConfigError (the CLI prints those on one line), not an
    # AttributeError traceback
    with pytest.raises(ConfigError) as ei:
        get_preset("tiny").with_overrides(modle={"num_layers": 3})
    assert "modle" in str(ei.value)
