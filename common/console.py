"""The console: every line the project prints, in a run, a command or a Ray worker, goes through the `flowrl` logger as
its message alone, so a user sees the project's own line formats (`[start] ...`, `[eval:...] ...`, `error: ...`):
information on standard output, errors on standard error, each flushed as it is written. The streams are looked up at
each line, so whatever a caller swapped in for them (a test's capture, a redirected stdout) receives it."""

from __future__ import annotations

import logging
import sys


class ConsoleHandler(logging.Handler):
    """Each record's message on sys.stdout, or on sys.stderr from ERROR up, flushed."""

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stderr if record.levelno >= logging.ERROR else sys.stdout
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own convention: a failed line is reported, the program goes on
            self.handleError(record)


log = logging.getLogger("flowrl")
if not any(isinstance(handler, ConsoleHandler) for handler in log.handlers):
    log.addHandler(ConsoleHandler())
    log.setLevel(logging.INFO)
    log.propagate = False  # a root handler (Ray's in its workers) would print each line twice, in its own format
