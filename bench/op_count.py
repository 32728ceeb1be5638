"""ATen ops dispatched by a block of code on CPU, where no kernel launch can be counted: how much host work a path
asks for (bench/smolvla_gpu.py reports it; the tests compare paths by it)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched inside `with OpCounter() as counter:`. Not the profiler: its background threads,
    started in a process that lives on (the test suite), can still run when the interpreter exits."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """A compiled step (actors.speed.compile_steps) runs compiled under the counter, which sees the ATen ops it still
        dispatches (matmuls, attention); torch.compile would run it eagerly under any other mode, from then on."""
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))

    def counts(self) -> dict[str, int]:
        return {"aten_ops": self.ops}
