"""Tidy signals (issue 39, item 7): what the server and its commands say is for a person to read.

* a worker's ready line is one short line (its details at DEBUG and in ``GET /config``);
* a refusal names the problem, never an internal exception (aiortc's parser refuses some offers with a bare
  ``AssertionError``; a decoder's error class);
* ``cadence generate`` draws no progress bar into a file or a pipe;
* the two agent latencies have two names (speech given to the character, the microphone ``mirror`` mouths),
  on the page as in the status.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_a_workers_ready_line_is_one_short_line():
    from cadence.engine.messages import WorkerInfo
    from cadence.serve.lines import worker_ready_line

    info = WorkerInfo(
        preset="character",
        device="cpu",
        tp=1,
        build_ms=6123.0,
        threads=2,
        fast_path={"graphs": False, "kv_fp8": False, "fp8_linears": 0} | {f"k{i}": i for i in range(40)},
        notes=["kv_fp8: needs a CUDA worker (this one runs on cpu): off"],
        warmup={"steady_chunk_ms": 47.6, "chunk_ms": [47.0] * 200, "graphs": {"x": 1}},
        preopen_ms=12.0,
        frame_transport="pipe",
        frames_per_chunk=4,
        audio_samples_per_chunk=8000,
        recipe={"model": "character", "rules": ["a rule"] * 30},
    )
    line = worker_ready_line(0, 4242, info)
    assert line == (
        "worker 0 ready (pid 4242): character on cpu, built in 6.1 s, warm-up 48 ms per chunk (one at a time), "
        "2 threads; 1 note below (details: GET /config)"
    )
    assert len(line) < 200 and "\n" not in line


def test_refusals_name_no_internal_exception():
    pytest.importorskip("aiortc")
    from cadence.serve.agent import decode_audio_bytes
    from cadence.serve.guard import ApiError, check_sdp

    with pytest.raises(ApiError) as e:  # matches the schema's pattern; aiortc's parser asserts on it
        check_sdp("v=0\r\nm=video\r\na=fingerprint:\r\n", "offer", 65536)
    assert e.value.status == 400 and "Error" not in e.value.message, e.value.message
    with pytest.raises(Exception) as e:
        decode_audio_bytes(b"RIFF\x00\x00\x00\x00WAVEfmt garbage")
    assert not re.search(r"\b[A-Z]\w*Error\b", str(e.value)), str(e.value)


def test_generate_draws_no_progress_bar_into_a_file(tmp_path, capsys):
    pytest.importorskip("av")
    from cadence.cli import main

    out = tmp_path / "clip.mp4"
    assert main(["generate", "--preset", "tiny", "--chunks", "2", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert out.is_file() and "chunks:" not in err and "chunk/s" not in err and "\r" not in err, err[-500:]


def test_the_page_names_the_two_latencies_the_status_gives():
    from cadence.serve.stats import SessionStats

    class _Metrics:
        def __getattr__(self, name):
            return self

        def __call__(self, *a, **k):
            return self

    fields = SessionStats(24, 4, 60.0, _Metrics(), "s", 0.0).status_fields(0.0, False)
    app = (ROOT / "cadence/serve/static/app.js").read_text()
    page = (ROOT / "cadence/serve/static/index.html").read_text()
    for field in re.findall(r"\bs\.((?:agent_audio|mic)_to_frame_ms_\w+)", app):
        assert field in fields, field
    assert "speech &rarr; frame" in page and "microphone &rarr; frame" in page
    assert "agent audio" not in page  # the name two measures once shared


# ---- fail fast and say why (issue 39, item 5) ----------------------------------------------------------------


def test_a_family_without_its_checkpoint_refuses_to_start_in_one_line_at_once(capsys, tmp_path):
    import time

    from cadence.cli import main

    for words in (
        ["serve", "--model", "self-forcing"],
        ["generate", "--model", "longlive", "--out", "x.mp4"],
    ):
        t = time.monotonic()
        assert main([*words, "--device", "cpu"] if words[0] == "generate" else words) == 2
        took = time.monotonic() - t
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and "--weights PATH" in err[0], err
        assert "--random-weights" in err[0] and took < 2.0, (err, took)


def test_random_weights_are_asked_for_and_said_plainly():
    import argparse

    from cadence.engine.flags import add_engine_flags, cpu_note, require_weights, spec_from_args
    from cadence.engine.recipe import EngineSpec, resolve

    p = argparse.ArgumentParser()
    add_engine_flags(p)
    args = p.parse_args(["--model", "self-forcing", "--random-weights"])
    spec = spec_from_args(args)
    require_weights(spec, args.random_weights)  # asked for: no error
    require_weights(EngineSpec(model="tiny"))  # Cadence's presets run as they are
    text = resolve(spec, "cpu").describe().text()
    assert "weights: random (seed 0): no checkpoint given, the frames are noise" in text, text
    # a GPU-sized model on the CPU says so before it builds; the CPU default and a GPU do not
    note = cpu_note(spec, "cpu")
    assert note is not None and "will not be real time" in note and "~1.4B" in note, note
    assert cpu_note(spec, "cuda:0") is None and cpu_note(EngineSpec(model="character"), "cpu") is None


def test_a_server_that_cannot_start_says_why_in_one_line():
    """A worker that cannot start (here: a CUDA group on a machine without CUDA): uvicorn logged Starlette's
    whole traceback, and ``cadence serve`` exited 3 after it; now one line says why."""
    import logging

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA (the worker must fail to start)")
    for mod in ("fastapi", "uvicorn", "aiortc", "prometheus_client"):
        pytest.importorskip(mod)
    from cadence.engine.recipe import EngineSpec
    from cadence.serve.config import ServeConfig
    from cadence.serve.server import ServerThread

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    cfg = ServeConfig(engine=EngineSpec(model="tiny"), groups=("cuda:0",), port=0, worker_start_timeout_s=60)
    srv = ServerThread(cfg)  # (uvicorn's config sets its loggers up: the handler goes on after it)
    logging.getLogger("uvicorn.error").addHandler(handler)
    try:
        with pytest.raises(RuntimeError, match=r"the server could not start: worker 0 \(cuda:0\)") as e:
            srv.start()
    finally:
        logging.getLogger("uvicorn.error").removeHandler(handler)
    assert "\n" not in str(e.value) and "Traceback" not in str(e.value)
    failed = [r.getMessage() for r in records if "could not start" in r.getMessage()]
    assert len(failed) == 1 and "\n" not in failed[0] and "Traceback" not in failed[0], failed
    assert not any("Traceback" in r.getMessage() or r.exc_info for r in records), [
        r.getMessage() for r in records
    ]
