"""The recipe (``cadence.engine.recipe``): one spec resolved per device, per family; the one flag set
(``cadence.engine.flags``) shared by every entry point; the kernel switches listed once; the docstring lists
that name code. Pure and torch-free: nothing here builds a model (the builds are in test_engine*.py)."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from cadence.config import PRESETS
from cadence.engine import flags
from cadence.engine.recipe import (
    KERNEL_SWITCHES,
    EngineSpec,
    choose_decoder,
    recipe_for,
    resolve,
    session_rules,
)
from cadence.engine.spec import FastPath
from cadence.errors import ConfigError
from cadence.model.families import (
    FAMILIES,
    REGISTRY,
    ClipStream,
    KVStream,
    Rebuild,
    Recache,
    Swap,
    family_config,
    get_model,
)

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "cadence"
NAMES = sorted(REGISTRY)


# ---- resolve: per family and device --------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu", "cuda:0", "cuda:0+cuda:1"])
@pytest.mark.parametrize("name", NAMES)
def test_every_model_resolves_on_every_device_with_nothing_left_undecided(name, device):
    r = resolve(EngineSpec(model=name), device)
    assert all(v is not None for v in dataclasses.asdict(r.fast).values()), r.fast
    c, cuda = r.config, device.startswith("cuda")
    assert r.fast.decoder == c.vae.decoder and r.warmup_chunks > 0 and r.tp == len(device.split("+"))
    assert r.fast.dtype == ("bfloat16" if cuda else "float32")
    match r.stream:
        case ClipStream() as clip:
            # no K/V cache: nothing of it on, its own decoder; graphs and the decoder's fast path where its
            # session applies them (FlashHead), on CUDA
            assert not (r.fast.kv_fp8 or c.stream.kv_fp8) and c.vae.decoder == r.rules.decoder.pinned
            assert r.fast.graphs == (cuda and clip.graphs) and c.stream.cache == "naive"
            assert r.fast.decoder_fast == ("compile" if cuda and clip.decoder_fast else "off")
            assert r.warmup_chunks == 2
            assert bool(r.notes) == cuda  # (on the CPU nothing was on to turn off)
        case KVStream() if r.rebuild is not None:  # Krea: the naive cache, whatever the device
            assert c.stream.cache == "naive" and not (r.fast.graphs or r.fast.kv_fp8)
            assert bool(r.notes) == cuda and (not cuda or "naive cache" in r.notes[0])
        case KVStream():  # the fast path on CUDA (the ring with FP8 K/V, graphs), the reference on the CPU
            if cuda:
                assert c.stream.cache == "ring" and c.stream.kv_fp8 and r.fast.graphs and r.fast.fp8_linears
            else:
                assert not (r.fast.graphs or c.stream.kv_fp8 or r.fast.fp8_linears)
            assert r.notes == ()
    assert resolve(EngineSpec(model=name), device) == r  # pure: the same answer every time
    d = r.describe(env={})
    assert json.loads(json.dumps(d.as_dict())) == d.as_dict() and name in d.text()
    assert d.as_dict()["fast"] == dataclasses.asdict(r.fast)  # every FastPath field, new ones included


def test_the_rules_each_family_declares():
    rules = {n: session_rules(family_config(n)) for n in FAMILIES}
    assert rules["flashtalk"].stream == ClipStream(33, 5, "cadence.engine.flashtalk:ClipSession")
    assert rules["flashtalk"].decoder.pinned == "wan" and rules["longlive"].decoder.pinned is None
    assert rules["longlive"].prompt_switch == Recache(keeps_sink=True)
    assert rules["krea-14b"].rebuild == Rebuild(frames=3, keep_first_frame=False)
    assert rules["self-forcing"].prompt_switch == Swap() and rules["self-forcing"].rebuild is None
    assert session_rules(PRESETS["tiny"]).prompt_switch == Swap(pad=False)  # a preset: the embedding as given
    # a rule folded into the configuration can be overridden there, and the session follows the config
    over = family_config("krea-14b", stream={"keep_first_frame": True})
    assert session_rules(over).rebuild == Rebuild(frames=3, keep_first_frame=True)


class ToyClipSession:
    """A clip family's own session class, in its own module (here: this test module)."""

    @classmethod
    def prepare(cls, gen) -> None: ...


def test_a_clip_family_enters_by_its_registry_entry(monkeypatch):
    """A new audio-driven clip family is an entry (its session class by name, its front ends typed) and its own
    files: the recipe, the session kind and the front ends follow the entry, no generic engine file names it."""
    import cadence.model.families as fams
    from cadence.engine.session import session_type

    flashtalk = fams.FAMILIES["flashtalk"]
    toy = dataclasses.replace(
        flashtalk,
        name="toy-clip",
        streaming=ClipStream(17, 1, session=f"{__name__}:ToyClipSession"),
        audio_encoder=fams.Wav2Vec2Audio("toy wav2vec2"),
        image_encoder=fams.VaeSinkImage(),
    )
    monkeypatch.setitem(fams.FAMILIES, "toy-clip", toy)
    r = resolve(EngineSpec(model="toy-clip"), "cuda:0")
    assert r.entry is toy and r.rules.audio == toy.audio_encoder and r.rules.image == fams.VaeSinkImage()
    assert session_type(r.rules) is ToyClipSession and r.warmup_chunks == 2
    assert r.config.vae.decoder == "wan" and any(n.startswith("toy-clip: graphs, kv_fp8") for n in r.notes)


def test_a_bare_krea_benchmark_gets_the_cache_its_rule_needs():
    """`cadence bench pipeline --model krea-14b --device cuda` (bare): the recipe, not the user, picks the naive
    cache Krea's rebuild needs (it used to exit 2: the benchmark's default cache was the ring); asking for the
    ring explicitly is still one clear error."""
    from cadence.bench.pipeline import bench_spec, parse

    r = resolve(bench_spec(parse(["--model", "krea-14b", "--device", "cuda"])), "cuda:0")
    assert r.config.stream.cache == "naive" and r.rebuild == Rebuild(3) and not r.fast.graphs
    assert r.fast.fp8_linears and r.config.vae.decoder == "taehv"  # the rest of the fast path stays
    with pytest.raises(ConfigError, match="naive cache only"):
        resolve(bench_spec(parse(["--model", "krea-14b", "--cache", "ring"])), "cuda:0")


def test_options_that_cannot_apply_are_notes_not_errors():
    r = resolve(EngineSpec("tiny", fast=FastPath(kv_fp8=True, graphs=True, capture_filling=True)), "cpu")
    assert not (r.fast.kv_fp8 or r.fast.graphs or r.fast.capture_filling) and len(r.notes) == 3
    r = resolve(EngineSpec("w14", decode_device="cuda:1"), "cuda:0+cuda:1")
    assert r.decode_device == "same" and "tensor-parallel" in r.notes[0]
    r = resolve(EngineSpec("w14", decode_device="cuda:1"), "cpu")
    assert r.decode_device == "same" and "cuda:1 mapped to cpu" in r.notes[0]
    assert resolve(EngineSpec("w14", decode_device="cuda:1"), "cuda:0").decode_device == "cuda:1"
    r = resolve(EngineSpec("flashtalk", fast=FastPath(decoder="taehv")), "cpu")
    assert r.config.vae.decoder == "wan" and "decoder taehv" in r.notes[0]


def test_the_automatic_decoder_reads_only_what_exists_says():
    w14 = PRESETS["w14"]
    given = w14.with_overrides(vae={"weights": "/ckpt/vae"})
    assert choose_decoder(given, True, exists=lambda p: False) == "wan"
    assert choose_decoder(given, True, exists=lambda p: p == "/ckpt/vae/taehv.safetensors") == "taehv"
    assert choose_decoder(w14, True, exists=lambda p: 1 / 0) == "taehv"  # no weights: nothing to look at
    assert choose_decoder(given, False, exists=lambda p: 1 / 0) == w14.vae.decoder  # the CPU: its own
    assert recipe_for(given, "cuda:0", exists=lambda p: False).config.vae.decoder == "wan"


def test_spec_errors_are_one_clear_line():
    with pytest.raises(ConfigError, match="unknown preset or model family 'w999'.*presets: .*families: "):
        EngineSpec(model="w999")
    with pytest.raises(ConfigError, match="decode device"):
        EngineSpec(decode_device="gpu1")
    with pytest.raises(ConfigError, match="no entries"):
        resolve(EngineSpec("krea-14b", weights_entry="generator"), "cpu")
    with pytest.raises(ConfigError, match="needs --weights"):
        resolve(EngineSpec("self-forcing", weights_entry="generator"), "cpu")


def test_presets_and_families_are_one_registry():
    assert set(REGISTRY) == set(PRESETS) | set(FAMILIES) and not set(PRESETS) & set(FAMILIES)
    assert get_model("TINY").kind == "preset" and get_model("krea-14b").kind == "family"
    p = flags_parser(flags.add_engine_flags)
    assert p.parse_args(["--preset", "krea-14b"]).model == p.parse_args(["--model", "krea-14b"]).model


# ---- one flag set ----------------------------------------------------------------------------------------------


def flags_parser(add, **kw) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add(p, **kw)
    return p


def test_every_fast_path_field_is_a_flag_with_its_docstring_as_help():
    p = flags_parser(flags.add_fast_path_flags)
    options = {a.dest: a for a in p._actions}
    docs = flags.field_docs(FastPath)
    for f in dataclasses.fields(FastPath):
        a = options["fast_" + f.name]
        assert docs.get(f.name), f"FastPath.{f.name} has no docstring (its flag's help)"
        assert a.help.startswith(
            docs[f.name].replace("%", "%%")[:40]
        ) and f"--{f.name.replace('_', '-')}" in (a.option_strings)
    args = p.parse_args(["--fp8", "--no-kv-fp8", "--dtype", "bf16", "--fast", "fp8", "--worker-threads", "2"])
    assert flags.fast_path_from_args(args) == FastPath(
        fp8_linears=True, kv_fp8=False, dtype="bfloat16", decoder_fast="fp8", threads=2
    )
    assert flags.fast_path_from_args(p.parse_args([])) == FastPath()  # unset: the defaults (None: automatic)
    with pytest.raises(SystemExit):
        p.parse_args(["--dtype", "int3"])


def test_a_field_added_to_the_fast_path_becomes_a_flag_by_itself(monkeypatch):
    """What the other helpers' fields get (attention: str, sequence_parallel: bool, gemm: str): a value flag or a
    --x/--no-x pair, its docstring as help, without touching the flag code."""

    @dataclasses.dataclass(frozen=True)
    class Grown(FastPath):
        attention: str = "auto"
        """The self-attention kernel."""
        sequence_parallel: bool = False
        """Shard the replicated work over the TP group."""

    monkeypatch.setattr(flags, "FastPath", Grown)
    p = flags_parser(flags.add_fast_path_flags)
    args = p.parse_args(["--attention", "fa3", "--sequence-parallel", "--fp8"])
    assert flags.fast_path_from_args(args) == Grown(attention="fa3", sequence_parallel=True, fp8_linears=True)
    helps = {a.dest: a.help for a in p._actions}
    assert helps["fast_attention"].startswith("The self-attention kernel. 'sdpa': ")  # + the registry's list
    assert flags.fast_path_from_args(p.parse_args(["--no-sequence-parallel"])).sequence_parallel is False


WORDS = [
    [],
    ["--model", "krea-14b"],
    ["--preset", "w1.3", "--fp8", "--kv-fp8", "--compile"],
    ["--preset", "w1.3", "--decoder", "wan", "--decoder-fast", "fp8", "--no-graphs", "--dtype", "bfloat16"],
    ["--model", "longlive", "--decode-gpu", "1", "--threads", "2", "--no-warmup"],
    ["--model", "flashtalk", "--tp", "2", "--warmup-chunks", "3", "--capture-filling"],
]


@pytest.mark.parametrize("words", WORDS, ids=lambda w: " ".join(w) or "bare")
def test_the_same_words_give_the_same_spec_through_serve_and_bench_pipeline(words):
    """A bare `cadence serve` and a bare `cadence bench pipeline` (and any other words both take) build the same
    EngineSpec, hence the same recipe on the same device."""
    from cadence.bench.pipeline import bench_spec, parse
    from cadence.cli import build_parser

    serve = flags.spec_from_args(build_parser().parse_args(["serve", *words]))
    bench = bench_spec(parse(words))
    assert serve == bench
    for device in ("cpu", "cuda:0"):
        assert resolve(serve, device) == resolve(bench, device)


def test_the_engine_flags_of_every_entry_point_are_the_same(capsys):
    """serve, generate, recipe and the bench commands pipeline / serve / turn / browser take the whole flag set;
    eval its model flags; bench vae the fast-path flags of a decoder."""
    from cadence.bench import browser, pipeline, turn, vae
    from cadence.bench import eval as beval
    from cadence.bench import serve as bserve
    from cadence.cli import build_parser

    fast = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(FastPath)}
    model = {"--model", "--preset", "--weights", "--weights-entry", "--ema", "--vae-weights", "--lora"}
    place = {"--decode-device", "--decode-gpu", "--warmup", "--prewarm", "--warmup-chunks"}

    def help_of(parse) -> str:
        with pytest.raises(SystemExit):
            parse(["--help"])
        return capsys.readouterr().out

    sub = build_parser()._subparsers._group_actions[0].choices
    for name in ("serve", "generate", "recipe"):
        opts = {o for a in sub[name]._actions for o in a.option_strings}
        assert fast | model <= opts, name
    for mod in (pipeline, bserve, turn, browser):
        out = help_of(mod.parse)
        assert all(o in out for o in fast | model | place | {"--tp"}), mod.__name__
    assert all(o in help_of(beval.parse) for o in model)
    assert all(o in help_of(vae.parse) for o in ("--dtype", "--decoder", "--decoder-fast", "--fast"))


def test_recipe_and_flags_are_torch_free():
    code = (
        "import sys, cadence.engine.recipe, cadence.engine.flags; "
        "from cadence.engine.flags import add_engine_flags, spec_from_args; import argparse; "
        "p = argparse.ArgumentParser(); add_engine_flags(p); "
        "r = cadence.engine.recipe.resolve(spec_from_args(p.parse_args(['--model', 'self-forcing'])), 'cuda:0'); "
        "r.describe().text(); sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_cadence_recipe_prints_what_the_words_build():
    out = subprocess.run(
        [sys.executable, "-m", "cadence", "recipe", "--model", "krea-14b", "--device", "cuda:0", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["cache"] == "naive" and d["rebuild"].startswith("Rebuild(frames=3") and d["fast"]["fp8_linears"]
    bad = subprocess.run(
        [sys.executable, "-m", "cadence", "recipe", "--model", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown preset or model family 'nope'"), (
        bad.stderr
    )


# ---- the commands in README.md and docs/ still parse ---------------------------------------------------------

FLAG_SET = {"serve", "generate", "eval", "recipe"}
#: The bench commands on the flag set (the engine's: pipeline, serve, browser, turn, eval; a decoder's: vae;
#: a part's: step, attention, cache, fused, linears).
BENCH_FLAG_SET = {
    "pipeline",
    "serve",
    "browser",
    "turn",
    "eval",
    "vae",
    "step",
    "attention",
    "cache",
    "fused",
    "linears",
}
_COMMAND = re.compile(r"(?:^|\s)(?:python3? -m |-m )?cadence ((?:bench )?[a-z]+)(.*)")


def _documented_commands() -> list[tuple[str, list[str]]]:
    """`cadence <cmd> ...` in README.md and docs/**/*.md (fenced blocks line by line, inline code spans) that use
    the flag set, normalised from their synopsis form: ``[--x]`` -> ``--x``, ``a|b`` -> ``a``, ``...`` dropped;
    and every benchmark command of the device plans, scripts/device_plans.toml (:func:`_plan_commands`)."""
    out = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        text = path.read_text()
        blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
        spans = re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
        lines = [ln for b in blocks for ln in b.replace("\\\n", " ").splitlines()] + [
            " ".join(s.split()) for s in spans
        ]
        out += _commands_in(path.relative_to(REPO), lines, BENCH_FLAG_SET)
    return out + _plan_commands()


def _plan_commands() -> list[tuple[str, list[str]]]:
    """The `cadence bench ...` commands of every device plan as the GPU runs it and as ``--smoke`` runs it on a
    CPU, expanded by the plan runner itself (scripts/device_plan.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("device_plan", REPO / "scripts" / "device_plan.py")
    runner = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = runner  # (dataclasses look their module up)
    spec.loader.exec_module(runner)
    out = []
    for name in runner.load_table():
        for smoke in (False, True):
            for step in runner.plan(name, smoke=smoke).steps:
                where = f"scripts/device_plans.toml: {name}{' --smoke' if smoke else ''} {step.name}"
                out += _commands_in(where, [step.command], BENCH_FLAG_SET, scripts=True)
    assert len(out) >= 40, len(out)
    return out


def _commands_in(
    where, lines: list[str], benches: set[str], scripts: bool = False
) -> list[tuple[str, list[str]]]:
    out = []
    for line in lines:
        for m in _COMMAND.finditer(line):
            cmd, rest = (
                m.group(1),
                re.split(r" / | # |; |\.\.\.| \| ", m.group(2))[0],
            )  # ' | ': a list, a pipe
            if scripts:  # a shell line: the command ends at a redirection, a pipe, a quote that closes it
                rest = re.split(r"\s(?:\d?>|\||&&)|[\"`]", rest)[0]
            name = cmd.split()[-1]
            if (cmd.startswith("bench ") and name in benches) or (
                not scripts and not cmd.startswith("bench") and cmd in FLAG_SET
            ):
                out.append((f"{where}: cadence {cmd}{rest}".strip(), [*cmd.split(), *_words(rest)]))
    return out


def _words(rest: str) -> list[str]:
    rest = rest.replace("[", " ").replace("]", " ").replace("\\|", "|")
    try:
        words = shlex.split(rest)
    except ValueError:
        words = rest.split()
    words = [w.split("|")[0] if "|" in w and not w.startswith("|") else w for w in words]
    # a placeholder value (N, S, K, PATH) stands for a number or a name: 1 reads as either
    words = ["1" if re.fullmatch(r"[A-Z][A-Z0-9_]*", w) else w for w in words]
    return [w for w in words if w and not w.startswith((">", "&", "2>", "|"))]


def test_every_documented_command_still_parses(capsys):
    """Every `cadence serve | generate | eval | bench pipeline|serve|browser|turn|eval|vae|step|attention|cache|
    fused|linears` command in README.md and docs/, and every benchmark command of the device plans,
    parses with today's flags (files it names need not exist: parsing checks spellings)."""
    from cadence.bench import browser, pipeline, turn, vae
    from cadence.bench import eval as beval
    from cadence.bench import serve as bserve
    from cadence.cli import build_parser

    cmds = _documented_commands()
    assert len(cmds) >= 10, cmds
    parsers = {"pipeline": pipeline.parse, "serve": bserve.parse, "turn": turn.parse, "vae": vae.parse}
    bad = []
    for where, words in cmds:
        if not _parses(words, build_parser, parsers, browser, beval, capsys):
            bad.append(where)
    assert not bad, "documented commands that no longer parse:\n" + "\n".join(bad)


def _parses(words, build_parser, parsers, browser, beval, capsys) -> bool:
    """Whether ``words`` parse; a prose mention that names a flag without its value (`cadence serve --ray`) is
    read without that last flag (a renamed flag still fails: only a missing value is forgiven)."""
    for attempt in (words, words[:-1]):
        capsys.readouterr()
        try:
            _parse(attempt, build_parser, parsers, browser, beval)
            return True
        except SystemExit as e:
            if not e.code:
                return True
            if not (words[-1].startswith("--") and "expected one argument" in capsys.readouterr().err):
                return False
    return False


def _parse(words, build_parser, parsers, browser, beval) -> None:
    """Parse ``words`` with the parser its command runs (SystemExit on a usage error)."""
    import importlib

    if words[:2] == ["bench", "eval"] or words[0] == "eval":
        beval.parse(words[2 if words[0] == "bench" else 1 :], "cadence eval")
    elif words[:2] == ["bench", "browser"]:  # (its parse() also builds the server's spec: files must exist)
        p = argparse.ArgumentParser()
        browser._own_flags(p)
        flags.add_engine_flags(p)
        p.parse_args(words[2:])
    elif words[0] == "bench":
        parse = parsers.get(words[1]) or importlib.import_module(f"cadence.bench.{words[1]}").parse
        parse(words[2:])
    else:
        build_parser().parse_args(words)


# ---- the kernel switches, listed once ----------------------------------------------------------------------

NOT_KERNEL = {"CADENCE_API_KEY", "CADENCE_AGENT_API_KEY", "CADENCE_WORKER_LOG", "CADENCE_GIT"}


def _environment_reads() -> dict[str, str | None]:
    """Every ``os.environ.get("CADENCE_X"[, default])`` / ``os.environ["CADENCE_X"]`` in the package, with the
    literal default where there is one."""
    out: dict[str, str | None] = {}
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get" and node.args:
                owner = node.func.value
                if not (isinstance(owner, ast.Attribute) and owner.attr == "environ"):
                    continue
                key = node.args[0]
                if isinstance(key, ast.Constant) and str(key.value).startswith("CADENCE_"):
                    default = (
                        node.args[1].value
                        if len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                        else None
                    )
                    out.setdefault(key.value, default)
    return out


def test_the_kernel_switch_table_lists_every_switch_with_its_default():
    reads = _environment_reads()
    table = {s.name: s for s in KERNEL_SWITCHES}
    assert set(reads) - NOT_KERNEL == set(table), (
        "add the switch to KERNEL_SWITCHES (or remove it from the table)"
    )
    for name, default in reads.items():
        if name in table and default is not None:
            assert table[name].default == default, name
    d = resolve(EngineSpec("tiny"), "cpu").describe(env={"CADENCE_COMPILE": "0"})
    env = d.as_dict()["env"]
    assert env["CADENCE_COMPILE"] == {"value": "0", "default": "1", "set": True}
    assert "CADENCE_COMPILE=0" in d.text() and not env["CADENCE_TILES_TMA"]["set"]


# ---- docstring lists that name code -------------------------------------------------------------------------


def test_the_message_table_names_the_request_and_reply_unions():
    import typing

    from cadence.engine import messages

    doc = messages.__doc__
    web = re.search(r"web -> rank 0\s+(.+)", doc).group(1).split()
    back = re.search(r"rank 0 -> web\s+(.+)", doc).group(1).split()
    assert set(web) | {"Preopen"} == {t.__name__ for t in typing.get_args(messages.Request)}
    assert set(back) | {"Died"} == {t.__name__ for t in typing.get_args(messages.Reply)}


def test_the_families_docstring_lists_every_family():
    import cadence.model.families as fams

    section = fams.__doc__.split("\nFamilies (")[1].split("\nEach family declares")[0]
    listed = re.findall(r"^\* ``([a-z0-9.-]+)``", section, flags=re.M)
    assert sorted(listed) == sorted(FAMILIES)


def test_only_the_recipe_reads_a_family_s_rules():
    """Outside ``cadence.model.families`` (which declares them) and ``cadence.engine.recipe``, no module reads a
    family's behaviour fields; the generic engine never asks which family it runs."""
    reads = re.compile(
        r"(get_family|get_model)\([^()]*\)\.(streaming|prompt_switch|context)\b|\bfam\.(streaming|prompt_switch|context)\b"
    )
    gone = re.compile(r"\b(stream_kind|recache_keeps_sink|is_clip_family|clip_based)\b")
    readers = {str(p.relative_to(REPO)) for p in PKG.rglob("*.py") if reads.search(p.read_text())}
    assert readers <= {"cadence/engine/recipe.py", "cadence/model/families.py"}, readers
    assert not [str(p) for p in PKG.rglob("*.py") if gone.search(p.read_text())]
    generic = (PKG / "engine" / "engine.py").read_text() + (PKG / "engine" / "build.py").read_text()
    assert not re.search(r"get_family|get_model|\.family\b|flashtalk|krea|longlive|self-forcing", generic)
