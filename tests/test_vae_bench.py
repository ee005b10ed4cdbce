"""`cadence bench vae` on the CPU at a tiny size (base width 8, 64x64): the record it writes for each decoder and
fast path, and a compile that fails at its first call falling back to eager with one line."""

from __future__ import annotations

import json

import pytest

from cadence.bench import vae as bv

TINY = [
    "--variant",
    "2.1",
    "--height",
    "64",
    "--width",
    "64",
    "--base-dim",
    "8",
    "--chunks",
    "2",
    "--warmup",
    "1",
]


@pytest.mark.parametrize(
    "extra,name",
    [
        ([], "2.1-wan-float32"),
        (["--decoder", "taehv"], "2.1-taehv-float32"),
        (["--fast", "cl"], "2.1-wan-float32-cl-fastcl"),
    ],
)
def test_bench_vae_records_the_decode(tmp_path, extra, name):
    assert bv.main([*TINY, *extra, "--out-dir", str(tmp_path)]) == 0
    (path,) = (tmp_path / "vae").glob("*.json")
    assert path.name.endswith(f"-cpu-wan2.1-tp1-{name}.json")
    doc = json.loads(path.read_text())
    r = doc["results"]
    assert r["chunks"] == 2 and len(r["chunk_ms"]) == 2 and r["per_chunk_ms"] > 0 and r["first_chunk_ms"] > 0
    assert r["frames_per_chunk"] == 4 and r["base_dim"] == 8 and r["peak_mem_gib"] is None
    assert r["decoder"] == ("taehv" if "taehv" in extra else "wan")
    assert r["channels_last"] == ("cl" in extra) and (r["fast"] is not None) == ("--fast" in extra)
    assert doc["recipe"]["decoder"] == r["decoder"]  # the recipe of the decoder timed


def test_a_compile_that_fails_at_its_first_call_runs_eagerly(tmp_path, monkeypatch, capsys):
    calls = {"n": 0}

    def fake_compile(
        model, log
    ):  # "compiles" the stream's decode: the first call raises, as a failed compile
        real = model.stream

        def stream():
            st = real()
            decode = st.decode_chunk

            def first_fails(x):
                calls["n"] += 1
                if calls["n"] == 1:
                    raise RuntimeError("inductor: no C++ compiler")
                return decode(x)

            st.decode_chunk = first_fails
            return st

        model.stream = stream
        return [(model, "stream")]

    monkeypatch.setattr(bv, "_compile_blocks", fake_compile)
    r = bv.run(bv.parse([*TINY, "--compile", "--no-record"]))
    assert (
        "torch.compile failed at first call (RuntimeError: inductor: no C++ compiler); eager"
        in capsys.readouterr().err
    )
    assert r["compiled"] is False and r["per_chunk_ms"] > 0
