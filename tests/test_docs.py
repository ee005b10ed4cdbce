"""The repository holds its own documents, and what they state about the code is read from the code.

* No tracked file points at a document the repository does not hold: the briefing files the project was
  started from (named below in pieces, so this file does not name them) or any Markdown path under docs/ that is
  not there; every relative link of a Markdown file resolves.
* Paths in backticks in README.md and docs/*.md (``cadence/...``, ``tests/...``, ``scripts/...``) exist.
* docs/benchmarks.md: every ``results`` key it names for a benchmark is one that benchmark's files write (a
  string literal, or a keyword of ``dict(...)``, in the files the bullet names).
* docs/workloads.md: the preset table is ``cadence.config.PRESETS``.

The JSON records and logs under docs/perf/ are kept as the runs wrote them (older ones cite the briefing by
name) and are not read for pointers.
"""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BRIEFING = re.compile(
    r"\b(?:" + "|".join(("BENCH" + "MARKS", "MIS" + "SION", "DES" + "IGN", "REFER" + "ENCES")) + r")\.md"
)
SHARED = re.compile(r"\.\./" + "shared/")
DOC_PATH = re.compile(r"(?<![\w/.])docs/[A-Za-z0-9_./-]*?\.md\b")
MD_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
CODE_PATH = re.compile(r"`((?:cadence|tests|scripts|docs)/[A-Za-z0-9_./-]+)`")
TEXT = (".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".txt", ".html", ".js", ".cfg", "Dockerfile", "run")


def _tracked() -> list[Path]:
    """The tracked text files (records under docs/perf/ other than Markdown left out); the tree without git."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=30)
        names = out.stdout.split() if out.returncode == 0 else []
    except (OSError, subprocess.SubprocessError):
        names = []
    paths = [ROOT / n for n in names] or [
        p for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts and "__pycache__" not in p.parts
    ]
    out = []
    for p in paths:
        rel = p.relative_to(ROOT).as_posix()
        if not p.is_file() or not rel.endswith(TEXT) or "fixtures/" in rel:
            continue
        if rel.startswith("docs/perf/") and not rel.endswith(".md"):
            continue  # the records: as the runs wrote them
        out.append(p)
    return out


def test_no_file_points_at_a_document_the_repository_does_not_hold():
    files = _tracked()
    assert len(files) > 100, len(files)
    bad = []
    for p in files:
        rel = p.relative_to(ROOT).as_posix()
        for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if BRIEFING.search(line) or SHARED.search(line):
                bad.append(f"{rel}:{i}: a briefing file: {line.strip()[:120]}")
            for m in DOC_PATH.finditer(line):
                if not (ROOT / m.group(0)).is_file():
                    bad.append(f"{rel}:{i}: no such file {m.group(0)}")
            if rel.endswith(".md"):
                for m in MD_LINK.finditer(line):
                    target = m.group(1)
                    if "://" in target or target.startswith("mailto:"):
                        continue
                    if not (p.parent / target).exists():
                        bad.append(f"{rel}:{i}: broken link {target}")
    assert not bad, "pointers to documents the repository does not hold:\n" + "\n".join(bad)


def test_paths_named_in_the_readme_and_docs_exist():
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    bad = [
        f"{p.relative_to(ROOT)}: {m.group(1)}"
        for p in docs
        for m in CODE_PATH.finditer(p.read_text())
        if not (ROOT / m.group(1).rstrip("/")).exists()
    ]
    assert len(docs) >= 5
    assert not bad, "paths in README.md / docs/*.md that do not exist:\n" + "\n".join(bad)


def _bench_bullets() -> dict[str, tuple[list[str], list[str]]]:
    """docs/benchmarks.md's "`results`, by benchmark" list: bench -> (the files it names, the keys it names)."""
    text = (ROOT / "docs/benchmarks.md").read_text()
    section = text.split("### `results`, by benchmark", 1)[1].split("\n## ", 1)[0]
    out = {}
    for item in re.split(r"\n- ", "\n" + section)[1:]:
        m = re.match(r"`(\w+)` \(([^)]*)\):(.*)", item, flags=re.S)
        if not m:
            continue
        files = re.findall(r"`([\w/]+\.py)`", m.group(2))
        body = " ".join(m.group(3).split())
        keys = [k.strip() for group in re.findall(r"`\{([a-z_0-9, ]+)\}`", body) for k in group.split(",")]
        body = re.sub(r"\([^)]*\)", "", body)  # a parenthesis explains a key: its words are not keys
        keys += re.findall(r"`([a-z_0-9]+)`", body)
        out[m.group(1)] = (files, keys)
    return out


def test_the_documented_result_keys_are_the_ones_each_benchmark_writes():
    bullets = _bench_bullets()
    assert {"step", "cache", "attention", "fused", "pipeline", "serve", "soak", "eval", "vae"} <= set(bullets)
    bad = []
    for bench, (files, keys) in bullets.items():
        assert files and len(keys) >= 4, (bench, files, keys)
        src = "\n".join((ROOT / f).read_text() for f in files)
        written = re.compile(
            r"[\"'](\w+)[\"']|(?<![\w.])(\w+)=(?!=)"
        )  # a key literal, or a dict(...) keyword
        names = {a or b for a, b in written.findall(src)}
        bad += [f"{bench}: {k}" for k in keys if k not in names]
    assert not bad, "keys docs/benchmarks.md names that the benchmark's files do not write:\n" + "\n".join(
        bad
    )


def test_the_workload_table_is_the_presets():
    from cadence.config import PRESETS

    text = (ROOT / "docs/workloads.md").read_text()
    rows = {
        cells[0]: cells
        for line in text.splitlines()
        if line.startswith("| ") and (cells := [c.strip() for c in line.strip("|").split("|")])[0] in PRESETS
    }
    assert set(rows) == set(PRESETS), sorted(rows)
    for name, cells in rows.items():
        c = PRESETS[name]
        m, s, v = c.model, c.stream, c.vae
        want = [
            name,
            str(m.dim),
            f"{m.num_heads} x {m.head_dim}",
            str(m.ffn_dim),
            str(m.num_layers),
            "x".join(map(str, v.stride)) + f", {v.latent_channels}",
            f"{s.height}x{s.width}",
            str(c.tokens_per_chunk),
            str(s.latent_frames_per_chunk),
            f"{s.window_chunks} + {s.sink_frames}",
            str(c.kv_tokens),
        ]
        assert cells == want, (name, cells, want)


# ---- the README: read in one screen -----------------------------------------------------------------------

SCREEN = 60  # lines a newcomer reads before scrolling


def _fenced_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line inside a fenced code block."""
    out, inside = [], False
    for i, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            inside = not inside
        elif inside:
            out.append((i, line.strip()))
    return out


def _readme_commands() -> tuple[tuple[int, str], tuple[int, str]]:
    """The README's run command (installs, then `cadence serve`) and test command (installs, then pytest)."""
    lines = _fenced_lines((ROOT / "README.md").read_text())
    run = [(i, ln) for i, ln in lines if "pip install" in ln and ln.endswith("&& cadence serve")]
    test = [(i, ln) for i, ln in lines if "pip install" in ln and "&& python3 -m pytest -q" in ln]
    assert run and test, "the README's run and test commands (each: installs && the command) are not there"
    return run[0], test[0]


def _normal(cmd: str) -> str:
    return " ".join(cmd.replace("python3 -m pip", "pip").replace("pip install -q", "pip install").split())


def test_the_readme_gives_set_up_run_and_test_on_its_first_screen():
    text = (ROOT / "README.md").read_text()
    (i_run, run), (i_test, test) = _readme_commands()
    assert i_run <= SCREEN and i_test <= SCREEN, (i_run, i_test)
    before = "\n".join(text.splitlines()[: min(i_run, i_test)])
    assert "git clone" in before and "python3 -m venv" in before  # the two steps before them, named
    assert "'.[serve]'" in run and "'.[test]'" in test
    assert len(text.splitlines()) <= 120, "the README grew past a screen or two: move details to docs/"


def test_ci_runs_the_readmes_test_command():
    """.ci/run installs torch its own way (from local disk), then runs the README's test command's other parts."""
    (_, test) = _readme_commands()[1]
    ci = _normal((ROOT / ".ci" / "run").read_text())
    parts = [p.strip() for p in test.split("&&") if "pip install torch" not in p]
    assert len(parts) == 2, parts
    assert _normal(" && ".join(parts)) in ci, (parts, "not in .ci/run")
