"""policy.pi0: the pi0 and pi0.5 backends' own config section (their model lives in common.policy.pi0). Free of
torch and lerobot, so that a run's config validates before any backend is imported."""

from __future__ import annotations

from dataclasses import dataclass

from common.validation import require, require_choice, require_positive

# lerobot's Gemma sizes for pi0 / pi0.5 (its get_gemma_config: PaliGemma's gemma_2b, the expert's gemma_300m), plus
# "tiny" (64 wide) and "tiny_expert" (32 wide): two-layer Gemmas with a one-layer SigLIP, built offline for CPU tests
# (common.policy.pi0.TINY_GEMMA).
PI_GEMMA_VARIANTS = ("gemma_2b", "gemma_300m", "tiny", "tiny_expert")


@dataclass
class Pi0Config:
    """policy.pi0: the pi0 and pi0.5 backends (common.policy.pi0, lerobot's PI0Policy / PI05Policy); read only when
    policy.type is "pi0" or "pi05". Needs lerobot 0.6 (Python >= 3.12; docs/pi0.md)."""

    # Local directory holding a PaliGemma tokenizer (e.g. a copy of google/paligemma-3b-pt-224's tokenizer files).
    # "": a character tokenizer written offline at the model's vocabulary size (common.policy.pi0.pi_tokenizer_dir);
    # it runs the model at its real cost, but pretrained weights read a real tokenizer's ids.
    tokenizer_path: str = ""
    # A lerobot pi0 / pi0.5 checkpoint directory (its config.json + model.safetensors, e.g. a local copy of
    # lerobot/pi0_base or lerobot/pi05_base) whose weights initialise the model; every tensor must be in it. "": random init.
    lerobot_checkpoint: str = ""
    # lerobot's architecture (its defaults are pi0_base's and pi05_base's): the PaliGemma backbone and the action
    # expert, each one of PI_GEMMA_VARIANTS (tiny ones for both, or for neither).
    paligemma_variant: str = "gemma_2b"
    action_expert_variant: str = "gemma_300m"
    image_resolution: int = 224  # SigLIP's input side; frames are resized with padding to it, as lerobot does
    max_state_dim: int = 32  # pi0: the state is zero-padded to this width (>= policy.obs_dim); pi0.5 writes it into the prompt
    # pi0: load lerobot_checkpoint with state_proj freshly initialised at max_state_dim (pi0_base's is 32 wide,
    # Metaworld's state 39). Every other tensor still comes from the file. pi0.5 has no state projection.
    reinit_state_proj: bool = False
    max_action_dim: int = 32  # actions are zero-padded to this width; >= policy.action_dim
    # Prompt tokens, padded/truncated to this length. lerobot's defaults: 48 for pi0 (the instruction), 200 for pi0.5,
    # whose prompt also spells out the discretised state ("Task: ..., State: 128 97 ...;\nAction: "); a prompt
    # that does not fit is an error, never silently cut.
    tokenizer_max_length: int = 48
    # What trains (requires_grad; only these are broadcast to actors). By default the action expert's projections:
    train_action_proj: bool = True  # action_in_proj and action_out_proj
    train_time_mlp: bool = True  # pi0: action_time_mlp_in/out; pi0.5: time_mlp_in/out and the expert's adaRMS conditioning
    train_state_proj: bool = True  # pi0 only: the state token of the expert's suffix (it does not feed the prefix)
    train_noise_head: bool = True  # ReinFlow noise head
    train_critic: bool = True
    train_expert: bool = False  # the whole action expert transformer (its adaRMS layers go with train_time_mlp)
    train_vlm: bool = False  # PaliGemma (SigLIP + Gemma): re-encodes every minibatch

    def validate(self, path: str = "policy.pi0") -> None:
        require_positive(self, path, "image_resolution", "max_state_dim", "max_action_dim", "tokenizer_max_length")
        require_choice(self, path, "paligemma_variant", PI_GEMMA_VARIANTS)
        require_choice(self, path, "action_expert_variant", PI_GEMMA_VARIANTS)
        require(
            self.paligemma_variant.startswith("tiny") == self.action_expert_variant.startswith("tiny"),
            f"{path}.paligemma_variant and {path}.action_expert_variant must both be tiny ones or neither (the expert attends to "
            f"the backbone's keys, so their head sizes must agree), got {self.paligemma_variant!r} and {self.action_expert_variant!r}",
        )
