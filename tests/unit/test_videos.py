"""Videos as data: MP4 writing and composition, the choice of episodes to film, recording names."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import av
import numpy as np
import pytest

from common.recording import EpisodeRecording, recording_calls, select_episodes
from common.suites.metaworld import Layout
from common.video import caption, side_by_side, write_mp4


def decode(path: Path) -> np.ndarray:
    with av.open(str(path)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


def moving_square(frames: int, height: int, width: int) -> np.ndarray:
    """A white square sliding right over a dark gradient: every frame differs from the others."""
    video = np.zeros((frames, height, width, 3), np.uint8)
    video[..., 2] = np.linspace(0, 120, width, dtype=np.uint8)
    for t in range(frames):
        video[t, 4:14, 2 + 4 * t : 12 + 4 * t] = 255
    return video


def test_a_written_mp4_decodes_to_its_frames(tmp_path) -> None:
    video = moving_square(9, 48, 64)
    decoded = decode(write_mp4(tmp_path / "a" / "clip.mp4", video))
    assert decoded.shape == video.shape
    error = np.abs(decoded.astype(int) - video.astype(int)).mean(axis=(1, 2, 3))
    assert error.max() < 6  # lossy, but each frame is close to its original ...
    across = np.abs(decoded[1:].astype(int) - video[:-1].astype(int)).mean(axis=(1, 2, 3))
    assert (across > 2 * error[1:]).all()  # ... and not to its neighbour
    odd = decode(write_mp4(tmp_path / "odd.mp4", video[:3, :47, :63]))
    assert odd.shape == (3, 48, 64, 3)  # yuv420p's even sides, the edge repeated
    with pytest.raises(ValueError, match="uint8"):
        write_mp4(tmp_path / "bad.mp4", video.astype(np.float32))


def test_side_by_side_holds_the_shorter_episodes_last_frame_and_captions_draw_only_in_their_band() -> None:
    left, right = moving_square(3, 32, 40), moving_square(5, 32, 24)
    both = side_by_side(left, right)
    assert both.shape == (5, 32, 64, 3)
    np.testing.assert_array_equal(both[:3, :, :40], left)
    np.testing.assert_array_equal(both[3:, :, :40], np.stack([left[-1], left[-1]]))
    np.testing.assert_array_equal(both[:, :, 40:], right)
    with pytest.raises(ValueError, match="one height"):
        side_by_side(left, right[:, :16])

    frames = np.full((2, 64, 64, 3), 128, np.uint8)
    captioned = caption(frames, [["step 0"], ["step 1"]])
    changed = (captioned != frames).any(axis=(0, 3))
    rows, cols = np.nonzero(changed)
    assert rows.max() < 20 and cols.max() < 48  # the band in the top-left corner, nothing else
    assert not np.array_equal(captioned[0], captioned[1])  # the counter differs per frame
    with pytest.raises(ValueError, match="2 caption"):
        caption(np.concatenate([frames, frames]), [["a"], ["b"]])


def test_select_episodes_takes_each_tasks_first_success_and_failure_then_alternates() -> None:
    tasks = ["a"] * 6 + ["b"] * 3
    successes = [False, False, True, False, True, True] + [True, True, True]
    assert select_episodes(tasks, successes) == [0, 2, 6, 7]
    assert select_episodes(tasks, successes, per_task=1) == [2, 6]
    assert select_episodes(tasks, successes, per_task=4) == [0, 1, 2, 4, 6, 7, 8]
    assert select_episodes(tasks, successes, per_task=0) == []
    # shares as the driver deals them: actor -> indices of its evaluate() call's layouts
    shares = {0: np.array([0, 1, 2]), 1: np.array([3, 4, 5]), 2: np.array([6, 7, 8])}
    assert recording_calls(shares, [0, 2, 7]) == [(0, [0, 1, 2], [0, 2]), (2, [6, 7, 8], [1])]


def test_episode_recording_names() -> None:
    recording = EpisodeRecording("reach-v3", Layout("reach-v3", 6, 7), True, 41, np.zeros((42, 8, 8, 3), np.uint8))
    assert recording.file_name == "reach-v3_6-07_success_41steps.mp4"
    assert dataclasses.replace(recording, success=False).outcome == "failure"
