"""The observation record: validation, torch conversion, indexing and concatenation, feature slicing."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np
import pytest
import torch

from common.observation import Observation
from common.policy import index_features


def example(batch: int = 5, cameras: int = 2, length: int = 7) -> Observation:
    rng = np.random.default_rng(0)
    return Observation(
        state=rng.normal(size=(batch, 39)).astype(np.float32),
        images=rng.integers(0, 256, size=(batch, cameras, 8, 8, 3), dtype=np.uint8),
        tokens=rng.integers(0, 100, size=(batch, length)),
        token_mask=rng.random((batch, length)) < 0.7,
    )


def test_bad_fields_are_named() -> None:
    obs = example()
    with pytest.raises(ValueError, match=r"Observation\.images must be uint8.*never as floats"):
        Observation(obs.state, obs.images.astype(np.float32))
    with pytest.raises(ValueError, match="tokens and Observation.token_mask must be given together"):
        Observation(obs.state, tokens=obs.tokens)
    with pytest.raises(ValueError, match=r"Observation\.images has shape \(4, 2, 8, 8, 3\)"):
        Observation(obs.state, obs.images[:4])
    with pytest.raises(ValueError, match=r"Observation\.token_mask must be bool"):
        Observation(obs.state, tokens=obs.tokens, token_mask=obs.token_mask.astype(np.int64))
    with pytest.raises(ValueError, match="3 RGB channels"):
        Observation(obs.state, obs.images[..., :2].copy())
    tokens = np.zeros((5, 2, 4, 6), np.float32)  # two cameras' vision-tower tokens, 4 of width 6 each
    with pytest.raises(ValueError, match=r"Observation\.image_embeddings must be float32"):
        Observation(obs.state, image_embeddings=tokens.astype(np.float16))
    with pytest.raises(ValueError, match=r"Observation\.image_embeddings has shape \(5, 4, 6\)"):
        Observation(obs.state, image_embeddings=tokens[:, 0])


def test_to_torch_copies_read_only_arrays_and_keeps_dtypes() -> None:
    obs = example()
    for array in obs.present().values():
        array.setflags(write=False)  # as arrays handed out by Ray's object store are
    torch_obs = obs.to_torch("cpu")
    assert [t.dtype for t in torch_obs.present().values()] == [torch.float32, torch.uint8, torch.int64, torch.bool]
    torch_obs.images[0] = 0  # writable, and a copy: the shared array is untouched
    assert obs.images[0].any()
    np.testing.assert_array_equal(torch_obs.state.numpy(), obs.state)


@pytest.mark.parametrize("as_torch", [False, True])
def test_index_and_concat_are_inverse(as_torch: bool) -> None:
    obs = example(batch=6)
    obs = obs.to_torch() if as_torch else obs
    rows = torch.tensor([4, 0, 3]) if as_torch else np.array([4, 0, 3])
    picked = obs.index(rows)
    assert picked.batch_shape == (3,)
    np.testing.assert_array_equal(np.asarray(picked.images[0]), np.asarray(obs.images[4]))
    joined = Observation.concat([obs.index(slice(0, 2)), obs.index(slice(2, 6))])
    for name, array in obs.present().items():
        np.testing.assert_array_equal(np.asarray(getattr(joined, name)), np.asarray(array))
    with pytest.raises(ValueError, match="fields"):
        Observation.concat([obs, Observation(obs.state)])


def test_records_of_decisions_flatten_to_one_batch() -> None:
    per_decision = Observation(np.zeros((3, 2, 39), np.float32), np.zeros((3, 2, 1, 4, 4, 3), np.uint8))
    assert per_decision.batch_shape == (3, 2)
    flat = per_decision.flatten_leading()
    assert flat.batch_shape == (6,) and flat.images.shape == (6, 1, 4, 4, 3)
    env_axis = Observation.concat([per_decision, per_decision], axis=1)
    assert env_axis.batch_shape == (3, 4)


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


@dataclasses.dataclass
class Nested:
    cache: tuple[torch.Tensor, ...]
    by_name: dict[str, torch.Tensor]
    pair: Pair
    shared: float | None


def test_index_features_slices_every_tensor_of_any_structure() -> None:
    batch = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    features = Nested((batch, batch * 2), {"mask": batch > 4}, Pair(batch[:, 0], batch + 1), 0.5)
    rows = torch.tensor([7, 1, 1])
    sliced = index_features(features, rows)
    assert isinstance(sliced, Nested) and isinstance(sliced.pair, Pair) and sliced.shared == 0.5
    torch.testing.assert_close(sliced.cache[1], batch[rows] * 2, rtol=0, atol=0)
    torch.testing.assert_close(sliced.by_name["mask"], batch[rows] > 4, rtol=0, atol=0)
    torch.testing.assert_close(sliced.pair.a, batch[rows, 0], rtol=0, atol=0)
    torch.testing.assert_close(index_features(batch, slice(2, 4)), batch[2:4], rtol=0, atol=0)
