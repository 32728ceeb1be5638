"""What a CUDA-graphed decision (common.decision_graph) relies on, checked on CPU: the chain driven by noise given up
front is the chain that draws it step by step; SmolVLA's capture path embeds frames with the same numbers as lerobot's;
inside the capture context one decision reads nothing back to the host; and the constant uploads are served again,
not copied, while capturing. The graph replay itself needs a GPU: bench/smolvla_gpu.py compares it with the eager path
on the same noise there.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import Tensor

from common.decision_graph import reused_uploads
from common.flow import sample_chain
from common.policy.lerobot_compat import embed_whole_frames
from common.rollout import decide, decision_tensors
from tests.helpers.vla import HostReads, tiny_observations, tiny_smolvla


@pytest.fixture(scope="module")
def policy():
    return tiny_smolvla()


@pytest.mark.parametrize("deterministic", [False, True])
def test_noise_given_up_front_drives_the_same_chain_as_drawing_it(policy, deterministic) -> None:
    obs, batch = tiny_observations(policy, 3), 3
    shape = (batch, policy.chunk_size, policy.action_dim)
    with torch.no_grad():
        features = policy.encode(obs)
        drawn = sample_chain(policy, features, batch, deterministic=deterministic, generator=torch.Generator().manual_seed(5))
        generator = torch.Generator().manual_seed(5)
        noise = torch.stack([torch.randn(shape, generator=generator) for _ in range(policy.num_steps + 1)])
        given = sample_chain(policy, features, batch, noise=torch.zeros_like(noise) if deterministic else noise)
    assert torch.equal(drawn.chain, given.chain) and torch.equal(drawn.scores.log_prob, given.scores.log_prob)
    assert deterministic or not torch.equal(given.chain[:, 1], given.scores.mean[:, 0])  # the noise was injected


def test_whole_frame_embedding_equals_lerobots_embed_image(policy) -> None:
    vlm_with_expert = policy.vla.model.vlm_with_expert
    images, *_ = policy.lerobot_inputs(tiny_observations(policy, 2))
    with torch.no_grad():
        for frames in images:
            assert torch.equal(embed_whole_frames(vlm_with_expert, frames), vlm_with_expert.embed_image(frames))


def test_inside_the_capture_context_a_decision_reads_nothing_back_and_matches_the_eager_one(policy) -> None:
    obs = tiny_observations(policy, 2)
    noise = torch.randn(policy.num_steps + 1, 2, policy.chunk_size, policy.action_dim, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with HostReads() as plain:
            eager = decision_tensors(policy, obs, deterministic=False, noise=noise)
        with policy.capture_context(), HostReads() as capturable:
            captured = decision_tensors(policy, obs, deterministic=False, noise=noise)
    assert plain.seen, "lerobot's vision path reads the patch mask on the host; without that, this test proves nothing"
    assert capturable.seen == []
    for name, value in eager.items():
        assert torch.equal(value, captured[name]), name
    assert "embed_image" not in vars(policy.vla.model.vlm_with_expert)  # the context put lerobot's method back


def test_constant_uploads_are_served_again_and_new_ones_refused_while_capturing() -> None:
    uploads: dict = {}
    with reused_uploads(uploads, capturing=False, device_type="cpu"):
        first = torch.tensor([0, 1, 1], dtype=torch.bool, device="cpu")
        scale = torch.tensor(8.0, device="cpu")
        passed_through = torch.tensor(np.arange(3), device="cpu")  # array data is not a constant of the code: never kept
    assert len(uploads) == 2
    with reused_uploads(uploads, capturing=True, device_type="cpu"):
        assert torch.tensor([0, 1, 1], dtype=torch.bool, device="cpu") is first
        assert torch.tensor(8.0, device="cpu") is scale
        with pytest.raises(RuntimeError, match="not in its warm-up"):
            torch.tensor([1, 1, 1], dtype=torch.bool, device="cpu")
    assert torch.tensor([0, 1, 1], dtype=torch.bool, device="cpu") is not first  # torch.tensor is itself again
    assert passed_through.tolist() == [0, 1, 2]


@pytest.mark.parametrize("send_image_embeddings", [False, True])
def test_decide_without_a_graph_is_the_eager_path(policy, send_image_embeddings) -> None:
    obs = tiny_observations(policy, 2)
    numpy_obs = type(obs)(**{name: value.numpy() for name, value in obs.present().items()})
    policy.send_image_embeddings = send_image_embeddings
    try:
        with torch.no_grad():
            eager = decision_tensors(policy, obs, deterministic=True)
        decision = decide(policy, numpy_obs, deterministic=True)
    finally:
        policy.send_image_embeddings = False
    assert policy.decision_graph is None
    # a decision is the chain and its scores, and where the policy sends them its vision tower's tokens; the learner
    # values the states
    assert {name for name, value in vars(decision).items() if value is not None} == set(eager)
    assert ("image_embeddings" in eager) == send_image_embeddings
    for name, value in eager.items():
        np.testing.assert_array_equal(getattr(decision, name), value.numpy())


def test_what_the_warm_up_compiled_is_not_compiled_again_while_capturing() -> None:
    """actors.speed.compile_steps and actors.speed.compile_vision inside a CUDA graph: the capture replays what the warm-up
    compiled, the vision tower on the capture context's path. A compile while capturing would upload the step's
    constants to the device inside the capture, which it forbids; the constants the step's library builds with
    torch.tensor are baked into its compiled graph, so none is asked for there either."""
    from torch._dynamo.utils import counters

    from common.flow import compile_steps, transition

    policy = tiny_smolvla()
    obs = tiny_observations(policy, 2)
    torch._dynamo.reset()  # compiles of other tests' policies count towards the step's recompile limit
    compile_steps(policy, "actors.speed.compile_steps")
    policy.compile_vision("actors.speed.compile_vision")
    uploads: dict = {}

    def decision(capturing: bool) -> list[Tensor]:
        with torch.no_grad(), policy.capture_context(), reused_uploads(uploads, capturing=capturing, device_type="cpu"):
            features = policy.encode(obs)
            return [features.critic_input, *transition(policy, features, torch.zeros(2, policy.chunk_size, policy.action_dim), 1)]

    warmed = decision(capturing=False)
    compiled_graphs, kept = counters["stats"]["unique_graphs"], dict(uploads)
    captured = decision(capturing=True)
    assert compiled_graphs >= 2 and counters["stats"]["unique_graphs"] == compiled_graphs  # nothing compiled while capturing
    assert uploads == kept
    assert all(torch.equal(a, b) for a, b in zip(warmed, captured, strict=True))
