"""MP4 videos of episodes: frame captions, side-by-side composition, and writing with PyAV.

Frames are (H, W, 3) uint8 RGB, right way up (as the suites render them). PyAV's wheels carry their own
FFmpeg build (libx264 included), so no system ffmpeg is needed. Captions use Pillow's built-in font.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

# Metaworld steps at 80 Hz (frame_skip 5 x 2.5 ms); a third of that speed leaves a grasp visible to the eye.
DEFAULT_FPS = 30


def _as_frames(frames: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
    array = np.asarray(frames)
    if array.ndim != 4 or array.shape[-1] != 3 or array.dtype != np.uint8 or len(array) == 0:
        raise ValueError(f"frames must be a non-empty (T, H, W, 3) uint8 sequence, got shape {array.shape} dtype {array.dtype}")
    return array


def write_mp4(path: str | Path, frames: Sequence[np.ndarray] | np.ndarray, fps: int = DEFAULT_FPS) -> Path:
    """Encode (T, H, W, 3) uint8 frames as H.264 in an MP4 at `path` (parents created); returns the path.

    yuv420p (what every player decodes) needs even sides: an odd width or height gets its last column or row
    repeated once."""
    array = _as_frames(frames)
    height, width = array.shape[1:3]
    array = np.pad(array, ((0, 0), (0, height % 2), (0, width % 2), (0, 0)), mode="edge")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    import av  # here, not at the top: actors import this module, and only writing a video needs PyAV's FFmpeg

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.height, stream.width = array.shape[1:3]
        stream.pix_fmt = "yuv420p"
        for frame in array:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())  # flush the encoder's delayed frames
    return path


def caption(frames: Sequence[np.ndarray] | np.ndarray, lines: Sequence[Sequence[str]]) -> np.ndarray:
    """Frames with text drawn in their top-left corner over a dark band, `lines[t]` on frame t (one list of lines
    per frame, so a caption can count steps). Returns a new (T, H, W, 3) uint8 array."""
    array = _as_frames(frames)
    if len(lines) != len(array):
        raise ValueError(f"{len(lines)} caption(s) for {len(array)} frames")
    font = ImageFont.load_default(size=max(8, array.shape[1] // 20))
    out = np.empty_like(array)
    for t, (frame, text) in enumerate(zip(array, lines)):
        image = Image.fromarray(frame)
        draw = ImageDraw.Draw(image)
        box = draw.multiline_textbbox((3, 2), "\n".join(text), font=font, spacing=1)
        draw.rectangle((0, 0, box[2] + 3, box[3] + 2), fill=(0, 0, 0))
        draw.multiline_text((3, 2), "\n".join(text), font=font, fill=(255, 255, 255), spacing=1)
        out[t] = np.asarray(image)
    return out


def side_by_side(left: Sequence[np.ndarray] | np.ndarray, right: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
    """Two episodes in one frame sequence, left beside right; the shorter one holds its last frame until the other
    ends. Both must have the same frame height."""
    left, right = _as_frames(left), _as_frames(right)
    if left.shape[1] != right.shape[1]:
        raise ValueError(f"side_by_side needs frames of one height, got {left.shape[1]} and {right.shape[1]}")
    length = max(len(left), len(right))

    def held(frames: np.ndarray) -> np.ndarray:
        return np.concatenate([frames, np.repeat(frames[-1:], length - len(frames), axis=0)])

    return np.concatenate([held(left), held(right)], axis=2)
