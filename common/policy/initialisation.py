"""Building a model without drawing its random initialisation, for a model whose every tensor is then read from a
file."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from torch import Tensor

# torch.nn.init's fills, which module constructors call (nn.Linear's kaiming_uniform_, nn.Embedding's normal_, ...).
TORCH_INIT_FILLS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)


@contextlib.contextmanager
def initialisation_skipped() -> Iterator[None]:
    """While open, modules are built with their weights as allocated, not filled: torch.nn.init's fills (wherever a
    torch module imported them) and transformers' initialize_weights (when transformers is loaded) do nothing.
    Buffers their constructors compute (rotary frequencies, position ids) are computed as ever, and transformers
    still ties weights. For a model whose every tensor is then read from a file: a full-size pi0 spends most of its
    construction on the CPU drawing random weights that the file replaces."""
    import torch.nn.init as init

    def unfilled(tensor: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return tensor

    originals = {name: getattr(init, name) for name in TORCH_INIT_FILLS}
    swapped: list[tuple[Any, str, Any]] = []
    for module_name, module in list(sys.modules.items()):
        if module is not None and (module_name == "torch.nn.init" or module_name.startswith("torch.nn.modules.")):
            swapped += [(module, name, fill) for name, fill in originals.items() if getattr(module, name, None) is fill]
    modeling_utils = sys.modules.get("transformers.modeling_utils")
    if modeling_utils is not None:
        swapped.append((modeling_utils.PreTrainedModel, "initialize_weights", modeling_utils.PreTrainedModel.initialize_weights))
    for owner, name, _ in swapped:
        setattr(owner, name, unfilled)
    try:
        yield
    finally:
        for owner, name, original in swapped:
            setattr(owner, name, original)
