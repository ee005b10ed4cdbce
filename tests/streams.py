"""Test helper: a stream of chunks from a built generator through the one engine.

``engine_stream(gen, ...)`` is ``Engine(gen, PipelineConfig(overlap=False)).stream(...)``: the engine's own
loop with the decode inline (the serial order), a fresh session per call. Tests that check the model, the
caches or the sampler use it to generate; tests of the overlapped engine build an ``Engine`` themselves.
"""

from __future__ import annotations

from cadence.config import PipelineConfig
from cadence.engine.engine import Engine


def engine_stream(gen, image, prompt, audio, num_chunks, seed=0, **kw):
    return Engine(gen, PipelineConfig(overlap=False)).stream(
        image, prompt, audio, num_chunks, seed=seed, **kw
    )
