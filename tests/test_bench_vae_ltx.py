"""`cadence bench vae --decoder ltx` on the CPU at a tiny size: the record (every round, every mode, the ratio
to the plain module, the counted work), the released folder as weights, and bad flags as one error line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cadence.bench import vae as bv

TINY = ["--decoder", "ltx", "--height", "32", "--width", "32", "--frames", "17", "--widths", "8,16,32,32",
        "--latent-channels", "8", "--layers", "1,1,1,1,1", "--rounds", "2", "--warmup", "0",
        "--stream-chunk", "4"]  # fmt: skip
FIX = Path(__file__).parent / "fixtures" / "flashhead" / "ltx" / "VAE_LTX"


def test_bench_ltx_records_every_round_of_every_mode(tmp_path, capsys):
    assert bv.main([*TINY, "--modes", "off,cl", "--error", "--out-dir", str(tmp_path)]) == 0
    (path,) = (tmp_path / "vae").glob("*.json")
    assert path.name.endswith("-cpu-flashhead-lite-tp1-ltx-float32-off-cl-random.json")
    doc = json.loads(path.read_text())
    r = doc["results"]
    assert doc["command"].startswith("cadence bench vae --decoder ltx --height 32")
    assert (
        r["latent"] == [8, 3, 1, 1]
        and r["rounds"] == 2
        and r["modes"] == {"off": "plain", "cl": "channels_last"}
    )
    for mode in ("off", "cl"):
        for fig in ("decode_ms", "encode_ms", "stream_first_ms", "stream_total_ms"):
            f = r["per_mode"][mode][fig]
            assert len(f["rounds"]) == 2 and f["min"] <= f["median"] <= f["max"] and f["min"] > 0
    cl = r["per_mode"]["cl"]["decode_ms"]
    assert cl["vs_off"] > 0 and cl["faster"] == (
        max(cl["rounds"]) < min(r["per_mode"]["off"]["decode_ms"]["rounds"])
    )
    w = r["work"]
    assert w["decode_gmac"] > 0 and w["encode_clip_gmac"] > w["encode_motion_gmac"] > 0
    assert 0 < w["stream_first_chunk_work_share"] < 1
    err = r["decode_error_vs_fp32"]
    assert err["off"] == {"rel_l2": 0.0, "psnr_db": None} and err["cl"]["rel_l2"] < 1e-5
    assert "bench vae --decoder ltx: 17x32x32 float32" in capsys.readouterr().out


def test_bench_ltx_eager_runs_a_compile_mode_without_compiling(tmp_path):
    assert bv.main([*TINY, "--modes", "compile", "--eager", "--rounds", "1", "--out-dir", str(tmp_path)]) == 0
    (path,) = (tmp_path / "vae").glob("*.json")
    r = json.loads(path.read_text())["results"]
    assert path.name.endswith("-ltx-float32-compile-eager-random.json") and r["eager"] is True
    assert r["modes"] == {"compile": "channels_last (compile skipped (--eager))"}


def test_bench_ltx_reads_the_released_folder_format(tmp_path):
    args = ["--decoder=ltx", "--weights", str(FIX), "--height", "32", "--width", "16", "--rounds", "1"]
    assert bv.main([*args, "--warmup", "0", "--modes", "off", "--no-record"]) == 0
    assert not (tmp_path / "vae").exists()


@pytest.mark.parametrize(
    "extra,needle",
    [(["--modes", "off,fold"], "--modes takes off, cl, compile, fp8"), (["--rounds", "0"], "--rounds")],
)
def test_bench_ltx_bad_flags_are_one_error_line(extra, needle, capsys):
    with pytest.raises(SystemExit) as e:
        bv.main([*TINY, *extra, "--no-record"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cadence bench vae --decoder ltx:") and needle in err and "\n" not in err
