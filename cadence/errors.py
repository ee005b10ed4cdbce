"""Errors that carry a message meant for the user (CLI prints it on one line; HTTP maps it to 4xx)."""

import argparse
from typing import NoReturn

#: Exit status of a command that was used wrongly (a bad flag, a bad file, a bad count).
EXIT_USAGE = 2


class CadenceError(Exception):
    """Base class for errors Cadence reports to a user without a traceback."""


class ConfigError(CadenceError, ValueError):
    """An invalid configuration; the message names the offending numbers."""


class InputError(CadenceError, ValueError):
    """Bad user input: a missing file, a file that is not an image or not audio, a bad count."""


class WeightsError(CadenceError, KeyError):
    """A checkpoint that does not fit the model: missing/unexpected keys or shape mismatches."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it plain
        return str(self.args[0]) if self.args else ""


class UsageParser(argparse.ArgumentParser):
    """argparse with usage errors on one line (``error: prog: ... (see 'prog --help')``) and exit status 2,
    like every other Cadence error (``cadence`` and every subcommand that parses its own flags)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message} (see '{self.prog} --help')\n")


#: What CUDA appends to every error it raises (where to look it up, how to debug it): cut from a line a user
#: reads, which keeps only what went wrong.
_CUDA_BOILERPLATE = (
    "Search for `cuda",
    "CUDA kernel errors might be asynchronously reported",
    "For debugging consider passing CUDA_LAUNCH_BLOCKING",
    "Compile with `TORCH_USE_CUDA_DSA`",
)


def one_line(text: str) -> str:
    """``text`` as one line: CUDA's boilerplate sentences cut off, the rest's lines joined with spaces."""
    cut = len(text)
    for marker in _CUDA_BOILERPLATE:
        at = text.find(marker)
        if at >= 0:
            cut = min(cut, at)
    return " ".join(text[:cut].split())


def out_of_memory(text: str) -> bool:
    """Whether an error's text says a device ran out of memory (CUDA's, torch's OutOfMemoryError)."""
    low = text.lower()
    return "out of memory" in low or "outofmemoryerror" in low
