"""Every policy backend, declared once: the class that builds it, the config section it reads and its lerobot
counterpart, by policy.type. Free of torch (common.config validates against it); a backend's class is imported on first
use (common.policy.base.policy_class), so the MLP path never imports a VLA's dependencies."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Backend:
    policy_class: str  # "module:Class"
    section: str | None = None  # the PolicyConfig subsection it reads (policy.<section>); None: the shared fields only
    lerobot_type: str | None = None  # the lerobot policy type `python -m learner.export` writes; None: nothing to export
    state_in_prompt: bool = False  # the state is written into the prompt (pi0.5), so it has no state width to fit


BACKENDS: dict[str, Backend] = {
    "mlp_flow": Backend("common.policy.mlp:MLPFlowPolicy"),
    "smolvla": Backend("common.policy.smolvla.model:SmolVLAFlowPolicy", section="smolvla", lerobot_type="smolvla"),
    "pi0": Backend("common.policy.pi0.model:PiFlowPolicy", section="pi0", lerobot_type="pi0"),
    "pi05": Backend("common.policy.pi0.model:PiFlowPolicy", section="pi0", lerobot_type="pi05", state_in_prompt=True),
}
