"""The consoles every command prints through, made to outlive a reader that leaves.

``duetime bench sim --json r.json | head -1`` closes the pipe after one line. rich's
default answer to the broken pipe is ``SystemExit(1)`` at the next print, so a
command that prints its table before it writes ``--json`` / ``--plot`` lost them and
failed. The files are the work and the table one view of it: here the console falls
silent instead, and the command goes on to write its files and exits as it would have.
"""

from __future__ import annotations

import os
import sys
from typing import IO

from rich.console import Console


class ReaderSafeConsole(Console):
    """A rich console that stops printing, and nothing else, when its reader goes.

    ``to_stderr``: print on standard error instead, while a command writes its figures
    to standard output (``--json /dev/stdout | jq``), so that the table does not follow
    the JSON into the pipe. The command line's root callback clears it for each command.
    """

    to_stderr = False

    @property
    def file(self) -> IO[str]:
        return sys.stderr if self.to_stderr else super().file

    @file.setter
    def file(self, new_file: IO[str]) -> None:
        self._file = new_file

    def on_broken_pipe(self) -> None:
        """Point the closed stream at ``/dev/null`` so that later prints (and the flush
        at exit) land nowhere; a stream with no descriptor (a test's capture) is quieted."""
        try:
            fd = self.file.fileno()
        except (AttributeError, OSError, ValueError):
            self.quiet = True
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)


# emoji off: rich turned "trunc.csv:100:2" into "trunc.csv💯2" (file:line:field messages)
out = ReaderSafeConsole(emoji=False)
err = ReaderSafeConsole(stderr=True, soft_wrap=True, emoji=False)
