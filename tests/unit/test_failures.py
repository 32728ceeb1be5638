"""A stop signal that arrives while the driver waits on the learner's update takes effect once the update's row is held."""

from __future__ import annotations

import os
import signal

import pytest

from learner.runtime.failures import Terminated, stops_held


def stop_on_sigterm(signum, frame) -> None:
    raise Terminated()


@pytest.fixture
def sigterm_stops():
    """The run's handlers: SIGTERM raises Terminated, Ctrl-C KeyboardInterrupt (Python's own, which a process started in
    the background of a shell does not have: SIGINT is ignored there)."""
    previous = {
        signal.SIGTERM: signal.signal(signal.SIGTERM, stop_on_sigterm),
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
    }
    yield
    for stop, handler in previous.items():
        signal.signal(stop, handler)


@pytest.mark.parametrize("stop, raised", [(signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)])
def test_a_stop_inside_the_block_takes_effect_at_its_end(sigterm_stops, capsys, stop, raised) -> None:
    done = []
    with pytest.raises(raised):
        with stops_held("finishing the update and logging it"):
            os.kill(os.getpid(), stop)
            done.append("the row")
    assert done == ["the row"]
    assert f"[stopping] asked to stop ({signal.Signals(stop).name}): finishing the update and logging it first" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is stop_on_sigterm  # the run's own handler is back


def test_a_second_stop_inside_the_block_stops_at_once(sigterm_stops) -> None:
    done = []
    with pytest.raises(Terminated):
        with stops_held("finishing the update and logging it"):
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            done.append("the row")
    assert done == []


def test_without_a_stop_the_block_runs_and_the_handlers_are_as_they_were(sigterm_stops) -> None:
    with stops_held("finishing the update and logging it"):
        pass
    assert signal.getsignal(signal.SIGTERM) is stop_on_sigterm and signal.getsignal(signal.SIGINT) is signal.default_int_handler
