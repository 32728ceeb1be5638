"""lerobot's own commands behind the project's torchvision guard: `python -m learner.lerobot_tools train|eval ARGS`
runs `lerobot-train ARGS` or `lerobot-eval ARGS`, unchanged.

Where lerobot imports cleanly (the Python 3.12 line, whose torchvision matches torch) call lerobot-train and
lerobot-eval themselves. On the Python 3.11 line the registry's torchvision is a CUDA build beside the CPU torch, and
every lerobot command fails at its first import (`operator torchvision::nms does not exist`);
common.policy.torchvision_shim skips the registrations that fail, and this module applies it before lerobot's
command starts, and sets MUJOCO_GL=egl where it is unset (MuJoCo's headless renderer, which a machine without a screen
needs; the same `MUJOCO_GL=egl lerobot-eval ...` elsewhere). Nothing is fetched from the model hub (HF_HUB_OFFLINE=1 where
unset): a --dataset.root or --policy.path not on this machine is refused in one line before lerobot starts. Otherwise
the arguments, outputs and exit status are lerobot's (docs/lerobot.md).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from common.config import ConfigError
from common.policy.torchvision_shim import install_cpu_torchvision_shim
from learner.command_shell import run_command

COMMANDS = {"train": ("lerobot-train", "lerobot.scripts.lerobot_train"), "eval": ("lerobot-eval", "lerobot.scripts.lerobot_eval")}


# lerobot's arguments that name a directory it reads; lerobot would take a name not on this machine for a hub id.
LOCAL_DIRECTORIES = ("--dataset.root", "--policy.path")


def check_local_directories(arguments: list[str]) -> None:
    """Each directory LOCAL_DIRECTORIES names is on this machine (a dataset root with meta/info.json), or a ConfigError.
    With HF_HUB_OFFLINE=0 set, lerobot may fetch what it names from the hub, and nothing is checked."""
    if os.environ.get("HF_HUB_OFFLINE") == "0":
        return
    for argument in arguments:
        flag, _, value = argument.partition("=")
        if flag not in LOCAL_DIRECTORIES:
            continue
        path = Path(value).expanduser()
        if not path.is_dir() or (flag == "--dataset.root" and not (path / "meta" / "info.json").is_file()):
            what = "a LeRobotDataset directory (with meta/info.json)" if flag == "--dataset.root" else "a checkpoint directory"
            raise ConfigError(
                f"{flag}={value} is not {what} on this machine: lerobot would ask the model hub for it, which a run "
                "here never does (set HF_HUB_OFFLINE=0 to let it)"
            )


def run_lerobot(arguments: list[str]) -> int:
    if not arguments or arguments[0] not in COMMANDS:
        raise ConfigError(f"usage: python -m learner.lerobot_tools {{{','.join(COMMANDS)}}} [lerobot's arguments]")
    check_local_directories(arguments[1:])
    name, module_name = COMMANDS[arguments[0]]
    os.environ.setdefault("MUJOCO_GL", "egl")  # before MuJoCo's first import picks its OpenGL backend
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before huggingface_hub's first import reads it: nothing is fetched
    install_cpu_torchvision_shim()
    import importlib

    module = importlib.import_module(module_name)
    sys.argv = [name, *arguments[1:]]  # lerobot's parser reads the command line itself
    module.main()
    return 0


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    return run_command("python -m learner.lerobot_tools", lambda: run_lerobot(arguments))


if __name__ == "__main__":
    sys.exit(main())
