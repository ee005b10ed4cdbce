"""`cadence bench pipeline`'s additions for a fair family side-by-side (docs/perf/reference/NOTES.md): the peak GPU
memory over each stream, ``--lora`` through the one flag set (as serve and generate take it), and the pure
prompt-switch run (a new prompt of the same conditioning length every N chunks: the family's switch rule timed
alone, beside ``--shape-change-every``, which also changes the length)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from cadence.bench import pipeline
from cadence.errors import InputError


@pytest.mark.timeout(120)
def test_prompt_switch_run_keeps_the_length_and_times_the_switch_chunks(tmp_path, monkeypatch):
    from cadence.engine.session import Session

    seen: list[tuple[int, ...]] = []
    real = Session.set_prompt

    def spy(self, prompt):
        seen.append(tuple(prompt.shape))
        return real(self, prompt)

    monkeypatch.setattr(Session, "set_prompt", spy)
    argv = ["--preset", "tiny", "--chunks", "10", "--shape-change-every", "0", "--prompt-switch-every", "3"]
    assert pipeline.main([*argv, "--no-warmup", "--out-dir", str(tmp_path)]) == 0
    (f,) = (tmp_path / "pipeline").glob("*.json")
    r = json.loads(f.read_text())["results"]
    ps = r["prompt_switch_run"]
    assert ps["switch_chunks"] == [3, 6, 9] and ps["switches"] == 3 and ps["every"] == 3
    assert (
        seen == [(16, 64)] * 3 and ps["length"] == 16
    )  # tiny: text_len 16, text_dim 64: one shape throughout
    assert ps["rule"] == "Swap(pad=False)" and ps["chunks"] == 10
    assert ps["switch_latency_p50_ms"] > 0 and ps["other_latency_p50_ms"] > 0
    assert ps["switch_extra_ms"] == pytest.approx(ps["switch_latency_p50_ms"] - ps["other_latency_p50_ms"])
    assert "shape_change_run" not in r and r["shape_changes"] == 0
    assert r["peak_mem_gib"] is None and ps["peak_mem_gib"] is None  # the CPU: no GPU memory to report


def test_prompt_switch_every_must_not_be_negative(capsys):
    with pytest.raises(SystemExit):
        pipeline.parse(["--prompt-switch-every", "-1"])
    assert "--prompt-switch-every must be >= 0" in capsys.readouterr().err


def test_peak_memory_is_per_cuda_device_of_the_engine(monkeypatch):
    peaks = {"cuda:0": 3 * 2**30, "cuda:1": 2**29}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: peaks[str(d)])
    reset: list[str] = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: reset.append(str(d)))

    def eng(diffusion, decode):
        return types.SimpleNamespace(
            placement=types.SimpleNamespace(diffusion_device=diffusion, decode_device=decode)
        )

    assert pipeline.peak_memory_gib(eng("cuda:0", "cuda:0")) == {"cuda:0": 3.0}
    assert pipeline.peak_memory_gib(eng("cuda:0", "cuda:1")) == {"cuda:0": 3.0, "cuda:1": 0.5}
    assert pipeline.peak_memory_gib(eng("cpu", "cpu")) is None
    pipeline.reset_peak_memory(eng("cuda:0", "cuda:1"))
    assert reset == ["cuda:0", "cuda:1"]


def test_lora_goes_through_the_flag_set_as_serve_and_generate_take_it(tmp_path):
    from cadence.cli import build_parser
    from cadence.engine import flags

    lora = tmp_path / "style.safetensors"
    lora.write_bytes(b"")  # the words are checked here (the file exists); its keys at the load
    words = ["--model", "self-forcing", "--lora", f"{lora}:0.5"]
    spec = pipeline.bench_spec(pipeline.parse(words))
    assert spec.overrides["model"]["lora"] == (f"{lora.resolve()}:0.5",)
    assert spec == flags.spec_from_args(build_parser().parse_args(["serve", *words]))
    assert spec == flags.spec_from_args(build_parser().parse_args(["generate", *words]))
    with pytest.raises(InputError, match="no such file"):
        pipeline.bench_spec(pipeline.parse(["--lora", str(tmp_path / "missing.safetensors")]))
