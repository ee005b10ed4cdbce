"""The clip session's side of the speech cut-in (``FlashHeadSession.rewind``, ``CutInHistory``), on the tiny Lite
fixture (tests/fixtures/flashhead/SoulX-FlashHead-tiny, 64 x 64, 24 new frames a clip, 9 motion frames), float32
on the CPU.

A cut-in starts the next clip ``r`` frames before the end of the last one (frame k): its motion latents must be the
re-encode of the frames the session already sent before k (the uint8 frames, bit for bit), its audio window the
stream's up to k (the resampler's output of the lagged stream, exactly: a short stream keeps all of it), and the
frames before k stay what they were. Only the clip sessions cut in: a chunk-grid family's session kind has no
``cut_in_frames`` (its engine's ``cut_in`` is None), so its server never plans one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("soxr")
pytest.importorskip("transformers")

from cadence.config import get_preset  # noqa: E402
from cadence.engine.build import build_engine  # noqa: E402
from cadence.engine.flashhead import AUDIO_LAG  # noqa: E402
from cadence.engine.recipe import DEFAULT_MODEL, session_rules  # noqa: E402
from cadence.engine.session import session_type  # noqa: E402
from cadence.engine.spec import FastPath  # noqa: E402
from cadence.errors import InputError  # noqa: E402
from cadence.model.families import family_config  # noqa: E402
from cadence.model.flashhead_stream import encode  # noqa: E402
from cadence.model.wav2vec2 import Resampler  # noqa: E402

TINY_DIR = Path(__file__).parent / "fixtures" / "flashhead" / "SoulX-FlashHead-tiny"
F, MOTION, SPF = 24, 9, 1920  # Lite's new frames a clip, motion frames; 48 kHz samples a 25 fps frame


@pytest.fixture(scope="module")
def eng():
    cfg = family_config("flashhead-lite", weights=str(TINY_DIR), stream=dict(height=64, width=64))
    e = build_engine(cfg, "cpu", FastPath(), seed=3)
    yield e
    e.close()


def voice(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(n) / 48000
    return 0.3 * torch.sin(2 * torch.pi * 180 * t) * (
        1 + torch.sin(2 * torch.pi * 3 * t)
    ) + 0.05 * torch.randn(n, generator=g)


def session(eng):
    g = torch.Generator().manual_seed(1)
    image = torch.rand(3, 64, 64, generator=g) * 2 - 1
    return eng.gen.session(image, "", 5)


def test_only_the_clip_sessions_cut_in(eng):
    assert eng.cut_in() == (2 * F - MOTION, MOTION)  # two clips kept, 9 frames of motion before the cut
    kv = session_type(
        session_rules(get_preset(DEFAULT_MODEL))
    )  # the CPU default (`character`): the chunk grid
    assert not hasattr(kv, "cut_in_frames") and not hasattr(kv, "rewind")


def test_the_rebuilt_audio_window_is_the_streamed_one(eng):
    """Rewound by nothing, the rebuilt window and pending samples are the streamed session's, exactly."""
    s = session(eng)
    audio = voice(2 * F * SPF)
    s.step(audio[: F * SPF])
    s.step(audio[F * SPF :])
    got = s.heard.rebuild(s._new_audio())
    assert torch.equal(got.window, s.audio.window)
    assert torch.equal(got.pending, s.audio.pending)


def test_a_cut_in_clip_starts_from_the_frames_sent_before_it(eng):
    s = session(eng)
    audio = voice(3 * F * SPF)
    sent = torch.cat([s.step(audio[: F * SPF]), s.step(audio[F * SPF : 2 * F * SPF])])  # frames 0..47
    r = 10
    k = 2 * F - r  # the cut: frame 38
    state = s.clips.encode_generator.get_state()
    s.rewind(r)
    # (b) its motion latents: the re-encode of the 9 frames sent before k, as sent (uint8 -> [-1, 1])
    before = sent[k - MOTION : k].permute(3, 0, 1, 2).float() / 127.5 - 1.0
    g = torch.Generator().manual_seed(0)
    g.set_state(state)
    want = encode(s.clips.codec, before, g).float()
    assert torch.equal(s.clips.motion, want)
    # its audio window: the lagged stream resampled, ending at frame k; the samples after k pending
    whole = Resampler(48000, 16000).push(torch.cat([torch.zeros(AUDIO_LAG), audio[: k * SPF]]))
    end = k * 640
    assert torch.equal(s.audio.window[-end:], whole[:end].double())
    assert torch.equal(s.audio.pending, whole[end:])
    # one clip from the speech from k on; the frames before k kept as they were sent
    new = s.step(audio[2 * F * SPF : 3 * F * SPF])
    assert new.shape == (F, 64, 64, 3)
    kept = s.heard.frames  # the last two clips' frames: 14..37 as sent, then the new clip's 38..61
    first = s.heard.made - kept.shape[0]
    assert s.heard.made == k + F and first == k + F - 2 * F
    assert torch.equal(kept[: k - first], sent[first:k]) and torch.equal(kept[k - first :], new)
    assert s.cut_ins == 1


def test_a_rewind_past_what_the_session_keeps_is_refused(eng):
    s = session(eng)
    s.step(voice(F * SPF))
    with pytest.raises(InputError, match="keeps 24 frames"):
        s.rewind(F - MOTION + 1)  # the 9 frames before the cut would start before the first clip


def test_a_long_stream_keeps_11_s_and_rebuilds_the_same_window():
    """Past 11 s the history is cut (whole frames); the resampler restarted there differs in its first samples,
    more than the 8 s window before its end even two Pro clips (2.24 s) back, and elsewhere by float32 rounding
    only (soxr works in blocks, and a restart moves their boundaries: measured <= 3.6e-7 on a signal of
    amplitude ~0.7, bound 1e-6). What it holds back may differ (here 163 samples of 16 kHz): the pending samples
    agree where both have them, and each is less than the one frame of lag (640) the session's clips rely on."""
    from types import SimpleNamespace

    from cadence.engine.cut_in import cut_in_history
    from cadence.model.flashtalk import FlashTalkAudio

    def fresh():
        return FlashTalkAudio(SimpleNamespace(sample_rate=16000, fps=25), 48000, 33, 5)

    cut, whole = cut_in_history(fresh()), cut_in_history(fresh())
    whole.keep = 10**9
    frame = torch.zeros(28, 2, 2, 3, dtype=torch.uint8)
    for h in (cut, whole):
        h.push(torch.zeros(AUDIO_LAG))
    audio = voice(14 * 28 * SPF)  # 14 clips of 28 frames: 15.7 s
    for i in range(14):
        for h in (cut, whole):
            h.push(audio[i * 28 * SPF : (i + 1) * 28 * SPF], frame)
    assert cut.samples.numel() <= 11 * 48000 and cut.start > 0 and cut.start % SPF == 0
    for h in (cut, whole):
        h.rewind(56)
    a, b = cut.rebuild(fresh()), whole.rebuild(fresh())
    assert torch.allclose(a.window, b.window, rtol=0, atol=1e-6)
    n = min(a.pending.numel(), b.pending.numel())
    assert torch.allclose(a.pending[:n], b.pending[:n], rtol=0, atol=1e-6)
    assert 0 < a.pending.numel() < 640 and 0 < b.pending.numel() < 640
