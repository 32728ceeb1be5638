"""Flow policies: the backend-independent interface (base) and one module per backend.

`from common.policy import FlowPolicy, build_policy, ...` is the public surface; backends are looked up by
`policy.type` through `POLICY_TYPES` and imported only when used.
"""

from common.policy.base import (
    CHECKSUMS_FILE,
    CONFIG_FILE,
    OBS_CLIP,
    OBS_STD_FLOOR,
    POLICY_TYPES,
    WEIGHTS_FILE,
    CheckpointError,
    CheckpointWriteError,
    FlowPolicy,
    build_policy,
    concat_features,
    file_sha256,
    index_features,
    policy_class,
    read_policy_config,
    verify_checksums,
    write_directory_atomically,
)
from common.policy.mlp import MLPFlowPolicy

__all__ = [
    "CHECKSUMS_FILE",
    "CONFIG_FILE",
    "POLICY_TYPES",
    "WEIGHTS_FILE",
    "CheckpointError",
    "CheckpointWriteError",
    "FlowPolicy",
    "MLPFlowPolicy",
    "OBS_CLIP",
    "OBS_STD_FLOOR",
    "build_policy",
    "concat_features",
    "index_features",
    "policy_class",
    "read_policy_config",
    "verify_checksums",
    "write_directory_atomically",
    "file_sha256",
]
