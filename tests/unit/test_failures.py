"""A stop signal: what it raises wherever it arrives, the exit code it leaves, and how the driver holds it while the
learner's update or a stopping run's checkpoint is under way."""

from __future__ import annotations

import os
import signal

import pytest

from learner.runtime.failures import Terminated, handle_stop_signals, stop_exit_code, stop_on_signal, stops_held


@pytest.fixture
def stop_handlers():
    """The commands' handlers (handle_stop_signals), the process's own put back afterwards."""
    previous = {stop: signal.getsignal(stop) for stop in (signal.SIGTERM, signal.SIGINT)}
    handle_stop_signals()
    yield
    for stop, handler in previous.items():
        signal.signal(stop, handler)


@pytest.mark.parametrize("stop, raised, code", [(signal.SIGTERM, Terminated, 143), (signal.SIGINT, KeyboardInterrupt, 130)])
def test_a_stop_signal_raises_and_leaves_the_exit_code_a_scheduler_reads(stop_handlers, stop, raised, code) -> None:
    with pytest.raises(raised) as stopped:
        os.kill(os.getpid(), stop)
    assert type(stopped.value) is raised and stop_exit_code(stopped.value) == code


@pytest.mark.parametrize("stop, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_the_plain_interrupt_a_wait_raises_in_place_of_the_handlers_keeps_the_signals_exit_code(stop_handlers, stop, code) -> None:
    """Ray's waits (ray.get, ray.wait) raise a plain KeyboardInterrupt whatever the handler raised: the signal the handler
    noted decides. A command starting again starts with no stop noted."""
    with pytest.raises(KeyboardInterrupt):
        stop_on_signal(stop, None)
    assert stop_exit_code(KeyboardInterrupt()) == code
    handle_stop_signals()
    assert stop_exit_code(KeyboardInterrupt()) == 130


@pytest.mark.parametrize("stop, raised", [(signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)])
def test_a_stop_inside_the_block_takes_effect_at_its_end(stop_handlers, capsys, stop, raised) -> None:
    done = []
    with pytest.raises(raised):
        with stops_held("finishing the update and logging it"):
            os.kill(os.getpid(), stop)
            done.append("the row")
    assert done == ["the row"]
    assert f"[stopping] asked to stop ({signal.Signals(stop).name}): finishing the update and logging it first" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is stop_on_signal  # the command's own handler is back


def test_a_second_stop_inside_the_block_stops_at_once(stop_handlers) -> None:
    done = []
    with pytest.raises(Terminated):
        with stops_held("finishing the update and logging it"):
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
            done.append("the row")
    assert done == []


def test_every_stop_while_a_stopping_run_saves_is_noted_and_the_save_finishes(stop_handlers, capsys) -> None:
    done = []
    with stops_held("saving the checkpoint", stopping=True):
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        done.append("the checkpoint")
    assert done == ["the checkpoint"]
    assert capsys.readouterr().out.count("[stopping] asked to stop again") == 2
    assert stop_exit_code(KeyboardInterrupt()) == 143  # the first signal's


def test_without_a_stop_the_block_runs_and_the_handlers_are_as_they_were(stop_handlers) -> None:
    with stops_held("finishing the update and logging it"):
        pass
    assert signal.getsignal(signal.SIGTERM) is stop_on_signal and signal.getsignal(signal.SIGINT) is stop_on_signal
