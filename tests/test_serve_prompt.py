"""A live prompt change: ``POST /sessions/{id}/prompt`` switches the prompt from the next chunk on, through
the worker (a ``SwitchPrompt`` message applied to the first chunk request at or after its index); the
stream never stops. A worker-level check: the switched chunks differ from an unswitched stream's, the
chunks before the switch do not."""

import asyncio

import numpy as np
import pytest

for _mod in ("fastapi", "uvicorn", "aiortc", "httpx"):
    pytest.importorskip(_mod, reason=f"the serve extra is not installed ({_mod})")

from cadence.devtools.client import run_client
from cadence.engine.recipe import EngineSpec
from cadence.engine.spec import FastPath
from cadence.serve.config import ServeConfig
from cadence.serve.server import ServerThread

pytestmark = pytest.mark.timeout(120)


def test_prompt_changes_mid_stream_and_bad_requests_are_refused():
    import httpx

    async def go(url):
        created: dict = {}
        client = asyncio.ensure_future(run_client(url, 3.0, created=created))
        async with httpx.AsyncClient(timeout=30) as http:
            while "token" not in created:
                await asyncio.sleep(0.05)
            sid, auth = created["session_id"], {"authorization": f"Bearer {created['token']}"}
            await asyncio.sleep(1.0)
            r = await http.post(
                f"{url}/sessions/{sid}/prompt", json={"prompt": "a person smiling"}, headers=auth
            )
            assert r.status_code == 200, r.text
            at = r.json()["from_chunk"]
            assert at > 0
            bad = [
                await http.post(f"{url}/sessions/{sid}/prompt", json={"prompt": "  "}, headers=auth),
                await http.post(f"{url}/sessions/{sid}/prompt", json={"prompt": 3}, headers=auth),
                await http.post(f"{url}/sessions/{sid}/prompt", json={"text": "x"}, headers=auth),
                await http.post(f"{url}/sessions/{sid}/prompt", json={"prompt": "x"}),
            ]
            assert [b.status_code for b in bad] == [400, 400, 400, 401], [b.text for b in bad]
        return await client, at

    with ServerThread(ServeConfig(engine=EngineSpec(model="tiny", fast=FastPath(threads=1)), port=0)) as srv:
        res, at = asyncio.run(go(srv.url))
    assert res.error is None, res.error
    rep = res.report
    assert rep["prompt_switches"] == 1 and rep["errors"] == [], rep
    assert rep["chunks"]["done"] > at + 4  # chunks kept coming after the switch
    assert res.video_fps() > 22.0


def test_the_worker_applies_a_switch_from_its_chunk_on():
    """The worker's command loop itself (``run_commands``, in this process, the tiny engine): the same
    stream twice, the second with a SwitchPrompt for chunk 3; chunks 0-2 are identical, 3-5 differ."""
    import queue

    import torch

    from cadence.engine.messages import ChunkRequest, CloseSession, OpenSession, Stop, SwitchPrompt
    from cadence.engine.worker import _build, run_commands
    from cadence.media.image import default_reference_image
    from cadence.serve.config import worker_spec

    spec, _ = worker_spec(
        ServeConfig(engine=EngineSpec(model="tiny", fast=FastPath(threads=1)), frame_transport="pipe"),
        "cpu",
        0,
    )
    done: queue.Queue = queue.Queue()
    eng = _build(spec, 0, None, on_chunk=lambda res: done.put((res.tag, res.frames.numpy().copy())))
    cfg = eng.gen.cfg
    spc = cfg.audio_samples_per_chunk
    audio = np.random.default_rng(0).standard_normal(spc).astype(np.float32) * 0.1
    msgs: list = []
    for switch in (False, True):
        sid = f"s{int(switch)}"
        msgs.append(OpenSession(sid, None, "a person talking", 7))
        if switch:
            msgs.append(SwitchPrompt(sid, 3, "a completely different scene at night"))
        msgs += [ChunkRequest(sid, c, audio, 0.0) for c in range(6)]
        msgs.append(CloseSession(sid))
    msgs.append(Stop())
    it = iter(msgs)
    replies: list = []
    got = {}

    def next_msg():  # a close waits for its session's 6 chunks (a close drops the chunks not decoded yet)
        m = next(it)
        while isinstance(m, CloseSession) and sum(k[0] == m.sid for k in got) < 6:
            tag, frames = done.get(timeout=60)
            got[(tag[0], tag[1])] = frames
        return m

    with torch.no_grad():
        image = default_reference_image(cfg.stream.height, cfg.stream.width)
        run_commands(eng, next_msg, replies.append, image)
    eng.close()
    assert not [r for r in replies if type(r).__name__ == "Error"], replies
    assert len(got) == 12, sorted(got)
    for c in range(3):
        assert np.array_equal(got[("s0", c)], got[("s1", c)]), c
    for c in range(3, 6):
        assert not np.array_equal(got[("s0", c)], got[("s1", c)]), c
