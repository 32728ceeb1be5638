"""policy.smolvla: the SmolVLA backend's own config section (its model lives in common.policy.smolvla). Free of
torch and lerobot, so that a run's config validates before any backend is imported."""

from __future__ import annotations

from dataclasses import dataclass

from common.validation import require, require_positive


@dataclass
class SmolVLAConfig:
    """policy.smolvla: the SmolVLA backend (common.policy.smolvla); read only when policy.type is "smolvla"."""

    # Local directory holding the SmolVLM backbone's config, processor and tokenizer (a SmolVLA checkpoint
    # names a hub id, e.g. HuggingFaceTB/SmolVLM2-500M-Video-Instruct: this path replaces it; nothing is
    # downloaded). "": the tiny SmolVLM built offline for policy.image_size (common.policy.tiny_vlm).
    vlm_path: str = ""
    # A lerobot SmolVLA checkpoint directory (its config.json + model.safetensors, e.g. a local copy of
    # lerobot/smolvla_base) whose weights initialise the model; every tensor must be in it. "": random init.
    lerobot_checkpoint: str = ""
    # lerobot's SmolVLA architecture (its defaults are smolvla_base's).
    num_vlm_layers: int = 16  # first layers of the VLM's text model kept; <= its number of layers
    num_expert_layers: int = -1  # <= 0: as many as num_vlm_layers
    self_attn_every_n_layers: int = 2
    expert_width_multiplier: float = 0.75
    max_state_dim: int = 32  # the state is zero-padded to this width; >= policy.obs_dim
    # Load lerobot_checkpoint with state_proj freshly initialised at max_state_dim (the file's may be another
    # width): smolvla_base's is 32 wide, Metaworld's state 39. Every other tensor still comes from the file.
    reinit_state_proj: bool = False
    max_action_dim: int = 32  # actions are zero-padded to this width; >= policy.action_dim
    tokenizer_max_length: int = 48  # instruction tokens, padded/truncated to this length
    # What trains (requires_grad; only these are broadcast to actors). The VLM is frozen unless asked.
    train_action_proj: bool = True  # action_in_proj and action_out_proj
    train_time_mlp: bool = True  # action_time_mlp_in/out
    train_expert: bool = False  # the whole action expert transformer
    train_noise_head: bool = True  # ReinFlow noise head
    train_critic: bool = True
    train_state_proj: bool = False  # feeds the VLM prefix: training it re-encodes every minibatch
    train_vlm: bool = False  # the VLM backbone (vision + text): re-encodes every minibatch

    def validate(self, path: str = "policy.smolvla") -> None:
        require_positive(
            self, path, "num_vlm_layers", "self_attn_every_n_layers", "max_state_dim", "max_action_dim", "tokenizer_max_length"
        )
        width = self.expert_width_multiplier
        require(0 < width <= 1, f"{path}.expert_width_multiplier must be in (0, 1], got {width}")
        require(
            not self.lerobot_checkpoint or bool(self.vlm_path),
            f"{path}.lerobot_checkpoint is set but {path}.vlm_path is empty: a SmolVLA checkpoint names its VLM by hub "
            "id; set vlm_path to a local directory holding that backbone's config, processor and tokenizer",
        )
