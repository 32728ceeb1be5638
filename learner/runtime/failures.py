"""The failures that restart a run's learner or end the run, shared by the actor pool, the learner handle and the command
line (which turns them into one line and exit code 1, keeping the checkpoints), and the stop a scheduler asks for."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

from common.console import log

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class LearnerDiedError(RuntimeError):
    """The learner actor's process is gone."""


class LearnerWedgedError(LearnerDiedError):
    """The learner did not answer a call within its deadline, and was killed."""


class ActorsExhaustedError(RuntimeError):
    """Fewer rollout actors are left than actors.faults.min_alive."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, as a scheduler stops a job: the run keeps its progress as on Ctrl-C (a checkpoint), then
    `python -m learner.main` exits with 143 (128 + SIGTERM), which a scheduler reads as stopped, not crashed."""


@contextlib.contextmanager
def stops_held(what: str) -> Iterator[None]:
    """SIGTERM and Ctrl-C that arrive inside the block take effect at its end, as they would have at its start: the
    learner finishes an update it was asked for whatever the driver does, so the driver holds the update's row before it
    stops, and the checkpoint it then saves passes no iteration the log lacks. A second signal stops at once. Outside
    the main thread (where no handler can be set) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def hold(signum: int, frame: object) -> None:
        if received:
            raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
        received.append(signum)
        log.info(f"[stopping] asked to stop ({signal.Signals(signum).name}): {what} first")

    previous = {stop: signal.signal(stop, hold) for stop in STOP_SIGNALS}
    try:
        yield
    finally:
        for stop, handler in previous.items():
            signal.signal(stop, handler)
        if received:
            signal.raise_signal(received[0])  # the handler the run had: Terminated, KeyboardInterrupt, or the default
