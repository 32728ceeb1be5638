"""The code's rooms (docs/architecture.md): imports run one way, with no circle, and the rooms that must not reach Ray
or the learner do not."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGES = ("actors", "common", "learner", "bench")


def modules() -> dict[str, Path]:
    """Every module of the project's packages, by dotted name."""
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path) -> set[str]:
    """The modules `path` imports, wherever in it (a function's lazy import counts)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def project_imports() -> dict[str, set[str]]:
    known = modules()
    return {name: {imported for imported in imports(path) if imported in known and imported != name} for name, path in known.items()}


def test_no_module_imports_itself_through_others() -> None:
    graph = project_imports()
    finished: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            pytest.fail(f"import circle: {' -> '.join(trail[trail.index(name) :] + [name])}")
        if name in finished:
            return
        for imported in graph[name]:
            visit(imported, [*trail, name])
        finished.add(name)

    for name in graph:
        visit(name, [])


@pytest.mark.parametrize(
    ("room", "never"),
    [("common", ("learner", "actors", "bench", "ray")), ("actors", ("learner", "bench")),
     ("learner.update", ("learner.runtime", "ray")), ("learner.group", ("learner.runtime", "learner.update", "ray")),
     ("learner.bc", ("learner.runtime", "learner.update", "ray")), ("learner.files", ("learner.runtime", "learner.update"))],
)  # fmt: skip
def test_a_room_imports_nothing_above_it(room: str, never: tuple[str, ...]) -> None:
    known = modules()
    broken = sorted(f"{name} -> {imported}" for name, path in known.items() if name == room or name.startswith(f"{room}.")
                    for imported in imports(path) if any(imported == n or imported.startswith(f"{n}.") for n in never))  # fmt: skip
    assert not broken, broken
