"""The shell the project's commands run in (learner.pretrain, dataset, export, replay, sweep, diagnose, lerobot_tools;
learner.main keeps a run's own mapping of failures beside the same stop handling).

- Bad input is a ConfigError or CheckpointError raised before anything is written: one line naming the field or file
  and the fix, exit 2, no traceback.
- An output that could not be written (a full disk, an unwritable directory) is a CheckpointWriteError, and work that
  failed for a reason the command names (a tool it runs exiting with an error) a CommandFailed: one line, exit 1, and
  nothing half-written left (every output is written atomically or removed on failure).
- SIGTERM and Ctrl-C end the command as schedulers read it: exit 143 or 130, one line, what it was writing dropped as on
  any failure.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from common.config import ConfigError
from common.console import log
from common.storage import CheckpointError, CheckpointWriteError
from learner.runtime.failures import handle_stop_signals, stop_exit_code, stopped_by_sigterm

EXIT_BAD_INPUT, EXIT_FAILED = 2, 1


class CommandFailed(RuntimeError):
    """A command's work failed for the reason its text gives (exit 1, one line)."""


def run_command(prog: str, command: Callable[[], int | None]) -> int:
    """`command()`'s exit status (None: 0) in the shell above; `prog` begins its lines (`python -m learner.pretrain`)."""
    handle_stop_signals()
    try:
        return command() or 0
    except KeyboardInterrupt as stop:
        log.error(f"[{'stopped by SIGTERM' if stopped_by_sigterm(stop) else 'interrupted'}] {prog}: nothing unfinished was kept")
        return stop_exit_code(stop)
    except (CheckpointWriteError, CommandFailed) as exc:
        log.error(f"{prog}: error: {exc}")
        return EXIT_FAILED
    except (ConfigError, CheckpointError) as exc:
        log.error(f"{prog}: error: {exc}")
        return EXIT_BAD_INPUT


@contextlib.contextmanager
def input_checks() -> Iterator[None]:
    """The block checks a command's input: the errors bad input raises there (a ValueError, as ConfigError is; the OSError of
    a file missing or unreadable; the KeyError of a file without a field; the ImportError of an extra not installed) are
    refused as bad input, in their one line."""
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, OSError, KeyError, ImportError) as exc:
        raise ConfigError(str(exc)) from None
