"""Where benchmark results go (torch-free, so a benchmark's argument parsing stays light).

By default a run writes ``./cadence-results/<bench>/<date>-<device>-<preset>-tp<N>[-variant].json`` and a
line in ``./cadence-results/README.md``: running a benchmark from a checkout never touches the committed
records. ``--record`` writes into the checkout's ``docs/perf/`` (what a maintainer does to record a
measurement; an existing file is never overwritten), ``--out-dir DIR`` anywhere, ``--no-record`` nowhere.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: Where results go unless told otherwise: a folder in the current directory, never the committed records.
RESULTS_DIR = "cadence-results"


def add_record_flags(p) -> None:
    """``--out-dir DIR`` (default ./cadence-results), ``--record`` (into this checkout's docs/perf, the
    committed records: for maintainers recording a measurement) and ``--no-record`` (print only)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--out-dir",
        default=None,
        help=f"where the JSON (and the README line) go (default: ./{RESULTS_DIR}/<bench>/)",
    )
    g.add_argument(
        "--record",
        action="store_true",
        help="write into this checkout's docs/perf/<bench>/ (the committed records; never overwrites)",
    )
    p.add_argument("--no-record", action="store_true", help="print only; write no JSON")


def results_dir(args) -> Path:
    """The base folder ``record`` writes under, from the flags of :func:`add_record_flags`."""
    if getattr(args, "record", False):
        return REPO / "docs" / "perf"
    return Path(args.out_dir) if getattr(args, "out_dir", None) else Path.cwd() / RESULTS_DIR
