"""The errors the CLI turns into a one-line message and an exit code: 2 for bad input, 1 for a run that failed."""

from __future__ import annotations


class NboxError(Exception):
    """An error nbox reports as one line (``nbox: error: ...``) and exits with ``exit_code``."""

    exit_code = 1


class InputError(NboxError):
    """Bad input from the user: a file, a field, a value. The message is one line."""

    exit_code = 2


class RunFailed(NboxError, RuntimeError):
    """A run that did not finish (the training command, the real system, a cluster's agent or stub): not the input."""

    exit_code = 1


class TopologyError(InputError):
    """A topology file that cannot be used; the message names the file, the YAML path and the value."""

    def __init__(self, source: str, path: str, message: str):
        self.source = source
        self.path = path
        self.detail = message
        where = f"{source}: {path}" if path else source
        super().__init__(f"{where}: {message}")
