"""policy.pi0: the pi0 and pi0.5 backends' own config section (their model: common.policy.pi0.model). Free of
torch and lerobot, so that a run's config validates before any backend is imported."""

from __future__ import annotations

from dataclasses import dataclass

from common.policy.vla_config import VLASectionConfig
from common.validation import require, require_choice, require_positive

# lerobot's Gemma sizes for pi0 / pi0.5 (its get_gemma_config: PaliGemma's gemma_2b, the expert's gemma_300m), plus
# "tiny" (64 wide) and "tiny_expert" (32 wide): two-layer Gemmas with a one-layer SigLIP, built offline for CPU tests
# (common.policy.pi0.stand_ins.TINY_GEMMA).
PI_GEMMA_VARIANTS = ("gemma_2b", "gemma_300m", "tiny", "tiny_expert")


@dataclass
class Pi0Config(VLASectionConfig):
    """policy.pi0: the pi0 and pi0.5 backends (common.policy.pi0.model, lerobot's PI0Policy / PI05Policy); read only when
    policy.type is "pi0" or "pi05". Needs lerobot 0.6 (Python >= 3.12; docs/pi0.md). The fields every VLA section has
    are declared in common.policy.vla_config; pi0.5 writes the state into its prompt (no max_state_dim padding, no
    state projection), and its train_time_mlp also trains the expert's adaRMS conditioning. lerobot's prompt lengths
    (tokenizer_max_length): 48 for pi0 (the instruction), 200 for pi0.5, whose prompt also spells out the discretised
    state ("Task: ..., State: 128 97 ...;\\nAction: "); a prompt that does not fit is an error, never cut."""

    # Local directory holding a PaliGemma tokenizer (e.g. a copy of google/paligemma-3b-pt-224's tokenizer files).
    # "": a character tokenizer written offline at the model's vocabulary size (common.policy.pi0.stand_ins.pi_tokenizer_dir);
    # it runs the model at its real cost, but pretrained weights read a real tokenizer's ids.
    tokenizer_path: str = ""
    # lerobot's architecture (its defaults are pi0_base's and pi05_base's): the PaliGemma backbone and the action
    # expert, each one of PI_GEMMA_VARIANTS (tiny ones for both, or for neither).
    paligemma_variant: str = "gemma_2b"
    action_expert_variant: str = "gemma_300m"  # (with paligemma_variant, above)
    image_resolution: int = 224  # SigLIP's input side; frames are resized with padding to it, as lerobot does
    train_state_proj: bool = True  # pi0 only: the state token of the expert's suffix (it does not feed the prefix)

    def validate(self, path: str = "policy.pi0") -> None:
        super().validate(path)
        require_positive(self, path, "image_resolution")
        require_choice(self, path, "paligemma_variant", PI_GEMMA_VARIANTS)
        require_choice(self, path, "action_expert_variant", PI_GEMMA_VARIANTS)
        require(
            self.paligemma_variant.startswith("tiny") == self.action_expert_variant.startswith("tiny"),
            f"{path}.paligemma_variant and {path}.action_expert_variant must both be tiny ones or neither (the expert attends to "
            f"the backbone's keys, so their head sizes must agree), got {self.paligemma_variant!r} and {self.action_expert_variant!r}",
        )
