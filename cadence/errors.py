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
