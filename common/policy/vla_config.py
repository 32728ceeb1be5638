"""The fields every VLA backend's config section shares (policy.smolvla, policy.pi0): where its lerobot checkpoint
is, how its state, actions and prompt are padded, and what trains. Free of torch and lerobot, so that a run's config
validates before any backend is imported."""

from __future__ import annotations

from dataclasses import dataclass

from common.validation import require_positive


@dataclass
class VLASectionConfig:
    """A VLA backend's config section; each backend's subclass adds its architecture and backbone files."""

    # A lerobot checkpoint directory of the backend (its config.json + model.safetensors, e.g. a local copy of
    # lerobot/smolvla_base or lerobot/pi0_base) whose weights initialise the model; every tensor must be in it.
    # "": random init.
    lerobot_checkpoint: str = ""
    max_state_dim: int = 32  # the state is zero-padded to this width; >= policy.obs_dim
    # Load lerobot_checkpoint with state_proj freshly initialised at max_state_dim (the file's may be another width:
    # the base checkpoints' are 32 wide, Metaworld's state 39). Every other tensor still comes from the file.
    reinit_state_proj: bool = False
    max_action_dim: int = 32  # actions are zero-padded to this width; >= policy.action_dim
    tokenizer_max_length: int = 48  # prompt tokens, padded/truncated to this length
    # What trains (requires_grad; only these are broadcast to actors). The backbone is frozen unless asked.
    train_action_proj: bool = True  # action_in_proj and action_out_proj
    train_time_mlp: bool = True  # the flow time's MLP into the action expert
    train_state_proj: bool = False  # the state projection
    train_noise_head: bool = True  # ReinFlow noise head
    train_critic: bool = True  # the critic (value head) the project adds
    train_expert: bool = False  # the whole action expert transformer
    train_vlm: bool = False  # the VLM backbone (vision + language model): re-encodes every minibatch

    def validate(self, path: str) -> None:
        require_positive(self, path, "max_state_dim", "max_action_dim", "tokenizer_max_length")
