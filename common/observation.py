"""The typed observation record every policy backend accepts: robot state, camera frames, instruction tokens.

One record type travels the whole way: environments fill `state` and `images` (numpy), the rollout adds
the instruction's `tokens`/`token_mask` (tokenized once per env by the policy), rollout records store the
fields per decision in compact form (uint8 frames, int64 token ids), and the policy receives the same
record as torch tensors (`to_torch`). Backends read what they need: the MLP reads `state` only; SmolVLA
reads images, tokens/token_mask and state. Frames are never stored or sent as floats: a 64x64 RGB frame is
12 KB as uint8 and 48 KB as float32, and converting is the backend's first step. A VLA actor may record its
vision tower's tokens of the frames instead (`image_embeddings`, actors.speed.send_image_embeddings), which a VLA
reads in place of the frames, so the learner does not run the tower over them again.

Shapes (B = batch of observations):
  state       (B, state_dim) float32        env/robot state (Metaworld's 39-d vector)
  images      (B, C, H, W, 3) uint8         C camera frames, right way up
  tokens      (B, L) int64                  instruction token ids, padded to L
  token_mask  (B, L) bool                   True on real tokens
  image_embeddings  (B, C, T, D) float32    each camera's T vision-tower tokens of width D (lerobot's embed_image)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

Array = np.ndarray | Tensor

# Field name -> (dtype name every array of it must have, in numpy and torch alike; dims of ONE observation).
_SPEC: dict[str, tuple[str, int]] = {
    "state": ("float32", 1),
    "images": ("uint8", 4),
    "tokens": ("int64", 1),
    "token_mask": ("bool", 1),
    "image_embeddings": ("float32", 3),
}


@dataclass
class Observation:
    """A batch of observations every backend accepts. numpy inside rollout records, torch inside the policy."""

    state: Array  # (B, state_dim) float32   env/robot state
    images: Array | None = None  # (B, C, H, W, 3) uint8, right way up (never float in records)
    tokens: Array | None = None  # (B, L) int64   instruction token ids, padded to L
    token_mask: Array | None = None  # (B, L) bool  True on real tokens
    # (B, C, T, D) float32: the vision tower's tokens of each camera's frame, recorded by a VLA actor in place of `images`
    image_embeddings: Array | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """Leading dims shared by every field: (B,) for a policy batch, (T, N) inside a rollout record."""
        return tuple(self.state.shape[:-1])

    def present(self) -> dict[str, Array]:
        """The fields that are set, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def validate(self) -> None:
        """Dtypes, ranks and leading dims agree with the module docstring; raises ValueError naming the field."""
        if (self.tokens is None) != (self.token_mask is None):
            raise ValueError("Observation.tokens and Observation.token_mask must be given together")
        if self.state.ndim < 2:
            raise ValueError(f"Observation.state must be (batch..., state_dim), got shape {tuple(self.state.shape)}")
        lead = self.batch_shape
        for name, array in self.present().items():
            dtype, dims = _SPEC[name]
            if str(array.dtype).removeprefix("torch.") != dtype:
                hint = ": frames travel as uint8 0..255, never as floats" if name == "images" else ""
                raise ValueError(f"Observation.{name} must be {dtype}, got {array.dtype}{hint}")
            if array.ndim != len(lead) + dims or tuple(array.shape[: len(lead)]) != lead:
                raise ValueError(f"Observation.{name} has shape {tuple(array.shape)}: expected leading dims {lead} then {dims} dim(s)")
        if self.images is not None and self.images.shape[-1] != 3:
            raise ValueError(f"Observation.images must end in 3 RGB channels, got shape {tuple(self.images.shape)}")
        if self.tokens is not None and tuple(self.tokens.shape) != tuple(self.token_mask.shape):
            raise ValueError(f"Observation.token_mask shape {tuple(self.token_mask.shape)} != tokens {tuple(self.tokens.shape)}")

    def to_torch(self, device: torch.device | str | None = None) -> Observation:
        """Torch copy on `device` (numpy arrays from Ray are read-only shared memory: never wrap them in place)."""

        def convert(array: Array) -> Tensor:
            if isinstance(array, Tensor):
                return array.to(device)
            return torch.from_numpy(np.array(array)).to(device)

        return Observation(**{name: convert(array) for name, array in self.present().items()})

    def index(self, idx: Array | slice | int) -> Observation:
        """Rows `idx` of every field (a slice, an index array/tensor, or one row kept as a batch of 1)."""
        if isinstance(idx, int):
            idx = slice(idx, idx + 1)

        def take(array: Array) -> Array:
            if isinstance(array, Tensor) and isinstance(idx, Tensor):
                return array[idx.to(array.device)]
            if isinstance(array, np.ndarray) and isinstance(idx, Tensor):
                return array[idx.cpu().numpy()]
            return array[idx]

        return Observation(**{name: take(array) for name, array in self.present().items()})

    def flatten_leading(self) -> Observation:
        """(T, N, ...) per-decision arrays of a rollout record -> one batch of T*N observations."""
        return Observation(**{name: array.reshape(-1, *array.shape[2:]) for name, array in self.present().items()})

    @staticmethod
    def stack(observations: Sequence[Observation]) -> Observation:
        """(N, ...) batches, one per decision of a rollout, as one (T, N, ...) record. Every batch sets the same fields."""
        return Observation.concat([Observation(**{name: array[None] for name, array in obs.present().items()}) for obs in observations])

    @staticmethod
    def concat(observations: Sequence[Observation], axis: int = 0) -> Observation:
        """Join along `axis` (0: the batch; 1: the env axis of (T, N) records). Every record must set the same fields."""
        if not observations:
            raise ValueError("Observation.concat needs at least one observation")
        names = list(observations[0].present())
        for obs in observations[1:]:
            if list(obs.present()) != names:
                raise ValueError(f"Observation.concat: fields {list(obs.present())} differ from {names}")
        first = observations[0].state
        join = torch.cat if isinstance(first, Tensor) else np.concatenate
        return Observation(**{name: join([getattr(obs, name) for obs in observations], axis) for name in names})
