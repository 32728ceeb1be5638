"""lerobot's own commands behind the project's torchvision guard: `python -m learner.lerobot_tools train|eval ARGS`
runs `lerobot-train ARGS` or `lerobot-eval ARGS`, unchanged.

Where lerobot imports cleanly (the Python 3.12 line, whose torchvision matches torch) call lerobot-train and
lerobot-eval themselves. On the Python 3.11 line the registry's torchvision is a CUDA build beside the CPU torch, and
every lerobot command fails at its first import (`operator torchvision::nms does not exist`);
common.policy.torchvision_shim skips the registrations that fail, and this module applies it before lerobot's
command starts, and sets MUJOCO_GL=egl where it is unset (MuJoCo's headless renderer, which a machine without a screen
needs; the same `MUJOCO_GL=egl lerobot-eval ...` elsewhere). Nothing else differs: the arguments, outputs and exit status
are lerobot's (docs/lerobot.md).
"""

from __future__ import annotations

import os
import sys

from common.console import log
from common.policy.torchvision_shim import install_cpu_torchvision_shim

COMMANDS = {"train": ("lerobot-train", "lerobot.scripts.lerobot_train"), "eval": ("lerobot-eval", "lerobot.scripts.lerobot_eval")}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        log.error(f"usage: python -m learner.lerobot_tools {{{','.join(COMMANDS)}}} [lerobot's arguments]")
        return 2
    name, module_name = COMMANDS[argv[0]]
    os.environ.setdefault("MUJOCO_GL", "egl")  # before MuJoCo's first import picks its OpenGL backend
    install_cpu_torchvision_shim()
    import importlib

    module = importlib.import_module(module_name)
    sys.argv = [name, *argv[1:]]  # lerobot's parser reads the command line itself
    module.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
