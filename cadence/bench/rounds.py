"""Interleaved rounds: how every "x faster" of a benchmark is measured (docs/benchmarks.md: a ratio is a distribution).

    from cadence.bench.rounds import interleave, compare
    times = interleave({"cublas": t_cublas, "triton": t_triton}, rounds=5)   # A B, B A, A B, ...
    r = compare(times, base="cublas", variant="triton")
    print(r.text())            # "1.07x (0.98-1.12x over 5 rounds; faster: no)"

Each variant is a callable that runs and times ONE round of that variant (e.g. the median of a few CUDA-graph
replays, or one whole step) and returns milliseconds (or any time unit, the same for all). :func:`interleave`
calls them round by round, in an order that rotates every round (round i starts at variant i mod n), so no
variant always runs first after a pause or always follows the same neighbour; drift of the machine (clocks,
another tenant) then lands on every variant alike instead of on whichever ran in the slow minute.

:func:`compare` turns two variants' rounds into the ratio the benchmark prints: per round, base / variant (> 1:
the variant is faster), the median of those ratios and their min-max, and the verdict. A variant is called
**faster** only where its worst round beats the baseline's best (max(variant) < min(base)); slower where its
best round loses to the baseline's worst; otherwise "within noise". At least :data:`MIN_ROUNDS` rounds are
needed for a verdict (fewer: "too few rounds", never "faster").

How ``cadence bench attention`` should use it (that file is another helper's): per shape, build one closure per
backend that times a fixed number of graph replays and returns the median ms, ``interleave`` them with
``rounds=5`` (or more), and print ``compare(times, "cudnn_bf16", name).text()`` for every backend; the auto
table should list a backend for a shape only where ``compare(...).faster`` is True against the shape's current
pick.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

MIN_ROUNDS = 5


def interleave(variants: dict[str, Callable[[], float]], rounds: int = MIN_ROUNDS) -> dict[str, list[float]]:
    """Run every variant once per round, `rounds` rounds, the order rotating each round; return the times
    per variant (list in round order). A variant that raises ends the measurement of that variant only: its
    list stops there (the others go on)."""
    names = list(variants)
    out: dict[str, list[float]] = {n: [] for n in names}
    dead: set[str] = set()
    for i in range(max(1, rounds)):
        order = names[i % len(names) :] + names[: i % len(names)] if names else []
        for n in order:
            if n in dead:
                continue
            try:
                out[n].append(float(variants[n]()))
            except Exception:  # noqa: BLE001  (a variant that cannot run: its rounds so far stay)
                dead.add(n)
    return out


@dataclass(frozen=True)
class Ratio:
    """base / variant per round (> 1: the variant is faster), summarised."""

    base: str
    variant: str
    rounds: int
    median: float
    lo: float
    hi: float
    base_ms: tuple[float, float, float]  # median, min, max of the base's rounds
    variant_ms: tuple[float, float, float]
    verdict: str  # "faster" | "slower" | "within noise" | "too few rounds"

    @property
    def faster(self) -> bool:
        return self.verdict == "faster"

    def text(self) -> str:
        return (
            f"{self.median:.2f}x ({self.lo:.2f}-{self.hi:.2f}x over {self.rounds} rounds; "
            f"{self.variant} {'is faster' if self.faster else self.verdict})"
        )

    def as_dict(self) -> dict:
        return asdict(self)


def _summary(xs: list[float]) -> tuple[float, float, float]:
    return float(statistics.median(xs)), float(min(xs)), float(max(xs))


def compare(times: dict[str, list[float]], base: str, variant: str) -> Ratio | None:
    """The ratio of `base` over `variant` from interleaved rounds (None when either has no round). Rounds are
    paired by index (the same round of both); the verdict uses all rounds of each."""
    a, b = times.get(base) or [], times.get(variant) or []
    n = min(len(a), len(b))
    if n == 0:
        return None
    per = [a[i] / b[i] for i in range(n) if b[i] > 0]
    if not per:
        return None
    if n < MIN_ROUNDS:
        verdict = "too few rounds"
    elif max(b) < min(a):
        verdict = "faster"
    elif min(b) > max(a):
        verdict = "slower"
    else:
        verdict = "within noise"
    return Ratio(
        base,
        variant,
        n,
        float(statistics.median(per)),
        float(min(per)),
        float(max(per)),
        _summary(a),
        _summary(b),
        verdict,
    )


def compare_all(times: dict[str, list[float]], base: str) -> dict[str, dict]:
    """:func:`compare` of every other variant against `base`, as JSON-ready dicts."""
    out = {}
    for name in times:
        if name != base and (r := compare(times, base, name)) is not None:
            out[name] = r.as_dict()
    return out
