"""A CUDA-graph stand-in for CPU tests of the graph runner, the pipeline and the graphed bench step."""

from __future__ import annotations


class FakeGraph:
    """'Capturing' records the function; replay re-runs it and writes into a static output tensor, as a
    real replay refills the captured output's memory; reset marks it freed (a replay after that fails).
    ``FakeGraph.made`` lists every instance (tests clear it)."""

    made: list[FakeGraph] = []

    def __init__(self, fn):
        self.fn, self.output, self.replays, self.freed = fn, None, 0, False
        FakeGraph.made.append(self)

    def replay(self):
        assert not self.freed, "replay of a freed graph"
        out = self.fn()
        if self.output is None:
            self.output = out
        else:
            self.output.copy_(out)
        self.replays += 1

    def reset(self):
        self.freed = True
