"""The errors the CLI turns into a one-line message and exit code 2."""

from __future__ import annotations


class InputError(Exception):
    """Bad input from the user: a file, a field, a value. The message is one line."""

    exit_code = 2


class TopologyError(InputError):
    """A topology file that cannot be used; the message names the file, the YAML path and the value."""

    def __init__(self, source: str, path: str, message: str):
        self.source = source
        self.path = path
        self.detail = message
        where = f"{source}: {path}" if path else source
        super().__init__(f"{where}: {message}")
