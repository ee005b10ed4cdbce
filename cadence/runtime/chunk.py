"""Denoise one chunk through the cache and commit its K/V: the body of the chunk step.

Everything here is device work launched from Python ints and pre-built device tensors: no
``.item()``, no host reads, so the step can later be captured in a CUDA graph.

What repeats is not recomputed (each with its reference path, by switch):

* **The timestep path, once per distinct timestep** (``CADENCE_TIMESTEP_CACHE``, default 1; 0: every pass
  embeds its timestep, the reference). A pass's timestep embedding and its 6-way projection (float32 GEMVs: at
  W57 a [49152 x 8192] float32 weight read per pass) depend on the pass's timestep and the two time layers'
  weights only, and a generator's timesteps are one device tensor built once (``Schedule.device_timesteps``).
  :data:`PASS_TIMES` keeps, per (model, timesteps tensor), each index's :class:`~cadence.model.dit.PassTime`:
  every chunk after the first reads them. An entry is checked on every eager call (the timesteps tensor and
  the time layers' parameters: the same objects at the same version counters; else recomputed **into the same
  tensors**, so a CUDA graph that read them reads the new values) and dropped with its timesteps tensor. Under
  a CUDA graph (``cadence.runtime.graphs``) the captured passes read the kept tensors (the runner's eager
  warm-up filled them); a miss during a capture computes inside the graph and keeps nothing. Bitwise the
  reference's values (the same call on the same inputs).
* **The audio K/V, once per chunk** (``CADENCE_AUDIO_KV``, default ``chunk``; ``pass``: embedded and projected
  in every pass, the reference): the chunk's audio tokens and every audio block's K/V
  (``WanDiT.prepare_audio``) are computed before the passes and read by each. The text K/V are computed once
  per session already (``WanDiT.prepare_text``).
"""

from __future__ import annotations

import os
import weakref

import torch

from cadence.model.dit import PassTime, TextContext, WanDiT
from cadence.runtime.sampler import Schedule


def _params_signature(model) -> tuple:
    """Identity and version of the time layers' parameters: what a kept embedding depends on besides t."""
    mods = [getattr(model, n, None) for n in ("time_embed", "time_proj")]
    params = [p for m in mods if m is not None for p in m.parameters()]
    # an inference tensor has no version counter: its identity and storage stand in (never equal twice if new)
    return tuple((id(p), p.data_ptr() if p.is_inference() else p._version) for p in params)


class _Times:
    """One model's embeddings of one timesteps tensor: the index's PassTime, or None until asked."""

    def __init__(self, model, timesteps: torch.Tensor):
        self.model = weakref.ref(model)
        self.timesteps = weakref.ref(timesteps)
        self.version = timesteps._version
        self.params = _params_signature(model)
        self.times: list[PassTime | None] = [None] * timesteps.numel()

    def valid(self, model, timesteps: torch.Tensor) -> bool:
        return (
            self.model() is model
            and self.timesteps() is timesteps
            and self.version == timesteps._version
            and self.params == _params_signature(model)
        )


class PassTimes:
    """The kept :class:`~cadence.model.dit.PassTime` of each (model, timesteps tensor, index) (see the module
    docstring). ``get`` returns the same tensors for the same index on every call while nothing changed."""

    def __init__(self):
        self._entries: dict[tuple[int, int], _Times] = {}
        self.computed = 0  # embeddings computed (a hit computes none): tests

    def get(self, model: WanDiT, timesteps: torch.Tensor, i: int) -> PassTime:
        if timesteps.is_inference():  # no version counter to check a kept value against: computed each time
            return self._compute(model, timesteps, i)
        capturing = timesteps.is_cuda and torch.cuda.is_current_stream_capturing()
        key = (id(model), id(timesteps))
        entry = self._entries.get(key)
        stale = entry is not None and not entry.valid(model, timesteps)
        if entry is None or (stale and entry.timesteps() is not timesteps):
            if capturing:  # nothing kept from inside a capture (its memory is the graph's pool)
                return self._compute(model, timesteps, i)
            entry = self._entries[key] = _Times(model, timesteps)
            weakref.finalize(timesteps, self._entries.pop, key, None)
        elif stale:  # same tensor, new values or weights: recompute into the kept tensors
            if capturing:
                return self._compute(model, timesteps, i)
            for j, old in enumerate(entry.times):
                if old is not None:
                    new = self._compute(model, timesteps, j)
                    old.temb.copy_(new.temb)
                    old.temb6.copy_(new.temb6)
            entry.version, entry.params = timesteps._version, _params_signature(model)
        kept = entry.times[i]
        if kept is None:
            kept = self._compute(model, timesteps, i)
            if capturing:
                return kept
            entry.times[i] = kept
        return kept

    def _compute(self, model: WanDiT, timesteps: torch.Tensor, i: int) -> PassTime:
        self.computed += 1
        return model.pass_time(timesteps[i : i + 1])

    def clear(self) -> None:
        self._entries.clear()


#: The process's kept pass embeddings (denoise_chunk's).
PASS_TIMES = PassTimes()


def reuse_timesteps() -> bool:
    return os.environ.get("CADENCE_TIMESTEP_CACHE", "1") != "0"


def audio_once_per_chunk() -> bool:
    mode = os.environ.get("CADENCE_AUDIO_KV", "chunk")
    if mode not in ("chunk", "pass"):
        raise ValueError(f"CADENCE_AUDIO_KV must be chunk or pass, got {mode!r}")
    return mode == "chunk"


def _pass_time(model, timesteps: torch.Tensor, i: int, reuse: bool):
    """What forward_chunk gets as its timestep: the kept PassTime, or the 1-element slice (the reference)."""
    if reuse and hasattr(model, "pass_time"):
        return PASS_TIMES.get(model, timesteps, i)
    return timesteps[i : i + 1]


def denoise_chunk(
    model: WanDiT,
    cache,
    schedule: Schedule,
    commit: str,
    noise: torch.Tensor,
    text: TextContext,
    audio: torch.Tensor | None,
    timesteps: torch.Tensor,
    renoise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the passes of one chunk whose position the cache already knows (``begin_chunk``).

    noise [C, F, h, w] float32 is the starting latent; timesteps a device tensor of model timesteps:
    the passes', then (index ``passes``) the clean commit pass's (``Schedule.device_timesteps``: the
    family's ``context_noise``, else 0); renoise [passes - 1, C, F, h, w] fresh noise for the 'renoise'
    rule. `commit` is 'last_pass' (K/V written during the last pass) or 'clean_pass' (an extra pass on
    the denoised result writes them, as the Self-Forcing family does). Returns the clean latent
    (float32). The timestep embeddings and the audio K/V are computed once (module docstring).
    """
    x = noise
    last = schedule.passes - 1
    reuse = reuse_timesteps()
    if audio is not None and audio_once_per_chunk() and hasattr(model, "prepare_audio"):
        audio = model.prepare_audio(audio[None])  # an AudioKV, or None for a model without audio layers
    for i in range(schedule.passes):
        t = _pass_time(model, timesteps, i, reuse)
        v = model.forward_chunk(x, t, text, audio, cache, commit=(commit == "last_pass" and i == last))
        x = schedule.step(x, v, i, renoise[i] if renoise is not None and i < last else None)
    if commit == "clean_pass":
        n = schedule.passes
        model.forward_chunk(x, _pass_time(model, timesteps, n, reuse), text, audio, cache, commit=True)
    return x
