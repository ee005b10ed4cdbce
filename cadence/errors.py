"""Errors that carry a message meant for the user (CLI prints it on one line; HTTP maps it to 4xx)."""


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
