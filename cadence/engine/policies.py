"""The K/V session's policies: small objects, made from a family's rules, that the one K/V session calls at
fixed points instead of branching on the family.

* **Context** (where a chunk's K/V context comes from), called before and after every step:
  :class:`Committed` (the K/V committed by earlier chunks stay: every family but Krea) or :class:`Rebuilt`
  (``Rebuild``: Krea Realtime's cache cleared and refilled from a short clean context before every chunk,
  ``cadence.cache.rebuild``; with Krea's default first frame the step also yields Krea's decoded frames).
* **Prompt switch** (what a prompt change mid-stream does): :class:`Swapped` (``Swap``: the new prompt's
  cross-attention K/V from the next chunk on) or :class:`Recached` (``Recache``: LongLive's re-computation of
  the recent chunks' K/V under the new prompt, ``cadence.cache.recache``, which keeps their clean latents).

``policies_for(rules, gen)`` makes both from a session's :class:`~cadence.engine.recipe.SessionRules`.
"""

from __future__ import annotations

import logging
from collections import deque

import torch

from cadence.cache.rebuild import RebuildContext, rebuild
from cadence.cache.recache import PastChunk, recache
from cadence.errors import ConfigError
from cadence.model.families import Rebuild, Recache, Swap

log = logging.getLogger("cadence.engine")
_said: set[str] = set()


class Committed:
    """The K/V committed by earlier chunks stay in the cache: each chunk is placed after the last."""

    yields_pixels = False
    """Whether the step yields decoded frames itself (see :class:`Rebuilt`)."""

    def reset(self) -> None:
        pass

    def place(self, sess, frames: int) -> None:
        """Before a step: put the chunk into the cache (``begin_chunk``)."""
        sess.cache.begin_chunk(sess.next_frame, frames)

    def push(self, x: torch.Tensor) -> None:
        """After a step: its clean latent [C, F, h, w]."""

    def frames(self, sess, x: torch.Tensor) -> torch.Tensor:
        """What the step returns: its latent (the engine's decode stage decodes it)."""
        return x


class Rebuilt(Committed):
    """Krea's per-chunk context rebuild: the cache refilled in one clean pass over the context before every
    chunk after the first, the chunk run right after it. With Krea's default first frame (an older decoded
    pixel frame re-encoded) every chunk is decoded as Krea decodes it, and those are the frames shown: the
    step yields them (``yields_pixels``) and the engine's own decoder is not used."""

    def __init__(self, rule: Rebuild, gen):
        cfg = gen.cfg
        if gen.model.audio_embed is not None:
            raise ConfigError("kv_rebuild has no audio path (no audio-driven family uses it)")
        vae = None if rule.keep_first_frame else gen.vae
        if vae is not None and cfg.model.weights and not cfg.vae.weights and "rebuild-vae" not in _said:
            _said.add("rebuild-vae")  # trained weights, a random VAE: the re-encoded frame is noise
            log.warning(
                "the K/V rebuild's first frame is re-encoded by a Wan VAE with random weights (no "
                "--vae-weights): give the family's VAE, or stream.keep_first_frame=True"
            )
        self.context = RebuildContext(rule.frames, cfg.stream.latent_frames_per_chunk, vae)
        self.yields_pixels = self.context.decoder is not None
        self.timesteps = gen.timesteps

    def reset(self) -> None:
        self.context.reset()

    def place(self, sess, frames: int) -> None:
        ctx = self.context.context()
        if ctx is None:  # the first chunk: nothing to rebuild from
            sess.cache.begin_chunk(sess.next_frame, frames)
            return
        pos = rebuild(sess.model, sess.cache, ctx, sess.text, self.timesteps[-1:], frames)
        sess.cache.begin_chunk(pos, frames)

    def push(self, x: torch.Tensor) -> None:
        self.context.push(x.detach())

    def frames(self, sess, x: torch.Tensor) -> torch.Tensor:
        if not self.yields_pixels:
            return x
        return shown_frames(self.context.chunk_pixels, sess.index, sess.cfg.stream.latent_frames_per_chunk)


def shown_frames(pix: torch.Tensor, index: int, frames_per_chunk: int) -> torch.Tensor:
    """Krea's decoded chunk [3, T, H, W] in [-1, 1] -> the chunk's uint8 frames [4F, H, W, 3]. Krea drops the
    first 3 frames of its first block (it shows 6 of 1 + 4 (F - 1) = 9); a chunk here is 4F frames, so the
    first one starts with its first shown frame held for the missing 4F - 6: every frame after that is the
    one Krea shows."""
    if index == 0:
        pix = pix[:, 3:]
        pad = 4 * frames_per_chunk - pix.shape[1]
        pix = torch.cat([pix[:, :1].expand(-1, pad, -1, -1), pix], 1)
    return ((pix.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).contiguous()


class Swapped:
    """A prompt switch takes the new prompt's cross-attention K/V from the next chunk on; nothing is re-run."""

    keep = 0
    """Past chunks' clean latents kept for a re-cache (none)."""
    keeps_sink = True
    """A re-cache asked for explicitly (``switch_prompt(recache_kv=True)``) keeps the frame sink."""

    def __init__(self, rule: Swap | Recache):
        self.rule = rule
        self.pad = rule.pad
        self._past: deque[PastChunk] = deque(maxlen=self.keep)

    def clear(self) -> None:
        self._past.clear()

    def remember(self, index: int, frame: int, x: torch.Tensor) -> None:
        """After a step: its clean latent (kept only by a policy that re-caches)."""
        if self._past.maxlen:  # a copy: a replayed graph's output buffer is overwritten by the next replay
            self._past.append(PastChunk(index, frame, x.detach().clone()))

    def recache(self, sess, keeps_sink: bool) -> list[int]:
        """Recompute the kept chunks' K/V under the session's (new) prompt; returns the chunks re-cached."""
        if not self._past.maxlen:
            raise RuntimeError(f"this session keeps no past latents to re-cache (family rule {self.rule!r})")
        if sess.model.audio_embed is not None:
            raise ConfigError("the prompt-switch re-cache has no audio path (no audio-driven family uses it)")
        s, n = sess.cfg.stream, sess.gen.schedule.passes
        return recache(
            sess.model,
            sess.cache,
            list(self._past),
            sess.text,
            sess.gen.timesteps[n : n + 1],
            s.frame_sink_chunks,
            s.window_chunks,
            keeps_sink,
        )

    def after_switch(self, sess) -> list[int]:
        """What runs once the new prompt is set; returns the chunks re-cached."""
        return []


class Recached(Swapped):
    """LongLive's switch: the recent chunks' K/V recomputed under the new prompt first (one extra model pass),
    from the clean latents of the last frame-sink + window chunks, kept on the device."""

    def __init__(self, rule: Recache, window_chunks: int, frame_sink_chunks: int):
        self.keep = frame_sink_chunks + window_chunks
        super().__init__(rule)
        self.keeps_sink = rule.keeps_sink

    def after_switch(self, sess) -> list[int]:
        return self.recache(sess, self.keeps_sink)


def policies_for(rules, gen) -> tuple[Committed, Swapped]:
    """(context, prompt switch) policies for a K/V session of ``gen`` under ``rules`` (``SessionRules``)."""
    s = gen.cfg.stream
    context = Rebuilt(rules.rebuild, gen) if rules.rebuild is not None else Committed()
    match rules.prompt_switch:
        case Recache() as rule:
            switch: Swapped = Recached(rule, s.window_chunks, s.frame_sink_chunks)
        case rule:
            switch = Swapped(rule)
    return context, switch
