"""policy.smolvla: the SmolVLA backend's own config section (its model: common.policy.smolvla.model). Free of
torch and lerobot, so that a run's config validates before any backend is imported."""

from __future__ import annotations

from dataclasses import dataclass

from common.policy.vla_config import VLASectionConfig
from common.validation import require, require_hub_id, require_positive


@dataclass
class SmolVLAConfig(VLASectionConfig):
    """policy.smolvla: the SmolVLA backend (common.policy.smolvla.model); read only when policy.type is "smolvla". The fields
    every VLA section has are declared in common.policy.vla_config."""

    # Local directory holding the SmolVLM backbone's config, processor and tokenizer (a SmolVLA checkpoint
    # names a hub id, e.g. HuggingFaceTB/SmolVLM2-500M-Video-Instruct: this path replaces it; nothing is
    # downloaded). "": the tiny SmolVLM built offline for policy.image_size (common.policy.smolvla.stand_ins).
    vlm_path: str = ""
    # The hub id of the backbone vlm_path holds a copy of: a lerobot export names the backbone by it, so that the export
    # loads on another machine. "": the id lerobot_checkpoint's config names, recorded when the model loads it; with
    # neither, an export names vlm_path (python -m learner.export --hub-id names it then).
    vlm_hub_id: str = ""
    # lerobot's SmolVLA architecture (its defaults are smolvla_base's).
    num_vlm_layers: int = 16  # first layers of the VLM's text model kept; <= its number of layers
    num_expert_layers: int = -1  # <= 0: as many as num_vlm_layers
    self_attn_every_n_layers: int = 2  # every nth layer attends over prefix and action tokens together; the others cross-attend
    expert_width_multiplier: float = 0.75  # the action expert's width as a fraction of the VLM's
    # train_state_proj (False): the state projection feeds the VLM prefix, so training it re-encodes every minibatch.

    def validate(self, path: str = "policy.smolvla") -> None:
        super().validate(path)
        require_positive(self, path, "num_vlm_layers", "self_attn_every_n_layers")
        if self.vlm_hub_id:
            require_hub_id(self.vlm_hub_id, f"{path}.vlm_hub_id")
        width = self.expert_width_multiplier
        require(0 < width <= 1, f"{path}.expert_width_multiplier must be in (0, 1], got {width}")
        require(
            not self.lerobot_checkpoint or bool(self.vlm_path),
            f"{path}.lerobot_checkpoint is set but {path}.vlm_path is empty: a SmolVLA checkpoint names its VLM by hub "
            "id; set vlm_path to a local directory holding that backbone's config, processor and tokenizer",
        )
