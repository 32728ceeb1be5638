"""The one place that makes torchvision importable beside a CPU build of torch (needed by lerobot and
transformers' SmolVLM processor).

The registry's torchvision for torch 2.13 is a CUDA build (0.28.0+cu130). Its `_meta_registrations`
module registers meta kernels for its C++ operators (nms, roi_align, ...) at import, and beside a CPU
torch those operators do not exist, so `import torchvision` fails ("operator torchvision::nms does not
exist"). Nothing here uses those meta kernels (they serve torch.compile/fake tensors on torchvision's
detection ops), so an empty module takes their place. Applied only for a CPU torch with a CUDA torchvision,
and only before torchvision's first import; a matching CPU or CUDA pair imports untouched.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import torch

META_MODULE = "torchvision._meta_registrations"


def torchvision_is_cuda_build() -> bool:
    """Read torchvision's version file without importing it (importing is what fails)."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        return False
    version_file = Path(spec.origin).parent / "version.py"
    return version_file.is_file() and "+cu" in version_file.read_text()


def plain_import_fails() -> bool:
    """torch is CPU-only and torchvision a CUDA build: `import torchvision`, and so lerobot's policies, fail in an
    interpreter without this shim (a user's own, loading an export with lerobot alone)."""
    return torch.version.cuda is None and torchvision_is_cuda_build()


def plain_import_advice() -> str:
    """One line for a user who will load lerobot without the project, where plain_import_fails()."""
    from importlib.metadata import version

    return (
        f"lerobot alone cannot import on this machine: torchvision {version('torchvision')} is a CUDA build beside "
        f"torch {torch.__version__} (operator torchvision::nms does not exist); where lerobot loads it without this "
        "project, install the torchvision built for that torch, e.g. pip install torchvision=="
        f"{version('torchvision').split('+')[0]} --index-url https://download.pytorch.org/whl/cpu"
    )


def install_cpu_torchvision_shim() -> bool:
    """Skip torchvision's meta-kernel registrations when torch is CPU-only and torchvision is a CUDA build.
    Returns whether the shim was installed (idempotent)."""
    if META_MODULE in sys.modules or "torchvision" in sys.modules:
        return False
    if not plain_import_fails():
        return False
    sys.modules[META_MODULE] = types.ModuleType(META_MODULE)
    return True
