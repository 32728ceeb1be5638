"""Flow policies: the backend-independent interface (base), the MLP (mlp) and one package per VLA backend (smolvla, pi0),
each with its config section in a torch-free module of its own (`config`), its `model` and its `stand_ins`.

`from common.policy import FlowPolicy, build_policy, ...` is the public surface; backends are looked up by
`policy.type` in the torch-free registry (`common.policy.registry.BACKENDS`, each declared once) and imported only
when used. The names below are resolved on first access, so that importing a backend's config section (as
common.config does) imports neither torch nor any model.
"""

import importlib
from typing import Any

_BASE_NAMES = (
    "CONFIG_FILE",
    "OBS_CLIP",
    "OBS_STD_FLOOR",
    "WEIGHTS_FILE",
    "FlowPolicy",
    "build_policy",
    "concat_features",
    "index_features",
    "policy_class",
    "read_policy_config",
)
_STORAGE_NAMES = ("CHECKSUMS_FILE", "CheckpointError", "CheckpointWriteError", "verify_checksums", "write_directory_atomically")
_PUBLIC = {
    **dict.fromkeys(_BASE_NAMES, "common.policy.base"),
    **dict.fromkeys(_STORAGE_NAMES, "common.storage"),
    "MLPFlowPolicy": "common.policy.mlp",
    "BACKENDS": "common.policy.registry",
    "Backend": "common.policy.registry",
}  # name -> its module

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)
