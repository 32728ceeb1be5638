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


_stops_asked: list[int] = []  # the stop signals this process received, in order


def stop_on_signal(signum: int, frame: object) -> None:
    """The commands' handler of SIGTERM and SIGINT: Terminated or KeyboardInterrupt, the signal noted (stop_exit_code)."""
    _stops_asked.append(signum)
    raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


def handle_stop_signals() -> None:
    """SIGTERM and Ctrl-C stop the calling command through stop_on_signal, from its start with no stop noted (in the main
    thread only, where handlers live)."""
    _stops_asked.clear()
    for stop in STOP_SIGNALS:
        signal.signal(stop, stop_on_signal)


def stopped_by_sigterm(error: BaseException) -> bool:
    """Whether a stop (a KeyboardInterrupt) was SIGTERM's. Ray's waits (ray.get, ray.wait) raise a plain KeyboardInterrupt
    in place of whatever a signal handler raised, so the first stop signal noted decides where one was, not the type."""
    return isinstance(error, Terminated) or (isinstance(error, KeyboardInterrupt) and _stops_asked[:1] == [signal.SIGTERM])


def stop_exit_code(error: KeyboardInterrupt) -> int:
    """143 (128 + SIGTERM) for a stop SIGTERM asked for, which a scheduler reads as stopped; 130 for Ctrl-C."""
    return 128 + (signal.SIGTERM if stopped_by_sigterm(error) else signal.SIGINT)


@contextlib.contextmanager
def stops_held(what: str, *, stopping: bool = False) -> Iterator[None]:
    """SIGTERM and Ctrl-C that arrive inside the block take effect at its end, as they would have at its start: the
    learner finishes an update it was asked for whatever the driver does, so the driver holds the update's row before it
    stops, and the checkpoint it then saves passes no iteration the log lacks. A second signal stops at once.

    stopping: the block saves the progress of a run that is already stopping: every signal inside it is only noted, as
    the run ends after it anyway and a checkpoint abandoned half-written would keep nothing (SIGKILL still ends it at
    once). Outside the main thread (where no handler can be set) the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def hold(signum: int, frame: object) -> None:
        if received and not stopping:
            stop_on_signal(signum, frame)
        received.append(signum)
        _stops_asked.append(signum)
        log.info(f"[stopping] asked to stop{' again' if stopping else ''} ({signal.Signals(signum).name}): {what} first")

    previous = {stop: signal.signal(stop, hold) for stop in STOP_SIGNALS}
    try:
        yield
    finally:
        for stop, handler in previous.items():
            signal.signal(stop, handler)
        if received and not stopping:
            signal.raise_signal(received[0])  # the handler the run had: Terminated, KeyboardInterrupt, or the default
