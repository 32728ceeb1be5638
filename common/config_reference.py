"""The config reference, generated from the schema: every field of RunConfig and its sections with its type, default and
the comment it is declared with, as one markdown page (docs/reference/config.md).

    python -m common.config_reference > docs/reference/config.md

A field's doc is the comment block right above its declaration and the comment at its end, read from the source of
the dataclass that declares it (a VLA section's shared fields from VLASectionConfig). tests/unit/test_config.py fails
when the page and the schema part.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import sys
import tokenize
from typing import Any

from common.config import RunConfig

TITLE = "# Config reference"
PREAMBLE = (
    "Every field a run reads, generated from the schema (`python -m common.config_reference > docs/reference/config.md`;\n"
    "a test fails when the two part). Set any of them in a `--config` file or with `--set section.field=value`; the\n"
    "defaults are the embedded ones (`configs/pick_place.yaml` writes them out). A field's text is its declaration's comment."
)


def field_comments(cls: type) -> dict[str, str]:
    """field name -> its comment in the source of `cls` and of the classes it derives from: the comment lines right above
    the field's line and the comment at the end of it. A field declared right below another, with no comment above it
    of its own, that the comment above the first of them names, shares that comment and says so."""
    comments: dict[str, str] = {}
    for owner in reversed([klass for klass in inspect.getmro(cls) if dataclasses.is_dataclass(klass)]):
        source = inspect.getsource(owner)
        lines = source.splitlines()
        tokens = tokenize.generate_tokens(io.StringIO(source).readline)
        by_line = {token.start[0]: token.string.lstrip("#").strip() for token in tokens if token.type == tokenize.COMMENT}
        group = None  # the first of the declarations in a row (no blank line), whose comment above they share
        for number, line in enumerate(lines, 1):
            name = line.strip().split(":", 1)[0]
            if not (line.startswith("    ") and not line.startswith("     ") and ":" in line and name in owner.__annotations__):
                group = group if line.strip().startswith("#") else None
                continue
            above, at = [], number - 1
            while at >= 1 and lines[at - 1].strip().startswith("#"):
                above.insert(0, by_line[at])
                at -= 1
            group = name if above or group is None else group
            shared = [f"(with `{group}`, above)"] if not above and group != name and name in comments.get(group, "") else []
            trailing = [by_line[number]] if number in by_line else []
            comments[name] = " ".join(above + trailing + shared)
    return comments


def shown(value: Any) -> str:
    """A default as YAML would read it back: JSON for numbers, booleans, lists and mappings; strings as they are."""
    if isinstance(value, str):
        return f'"{value}"' if value == "" else value
    return json.dumps(value)


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def sections(config: Any, path: str) -> list[tuple[str, list[tuple[str, str, str, str]]]]:
    """(section path, rows of (field, type, default, doc)) for `config` and, after it, each of its nested sections."""
    comments = field_comments(type(config))
    rows, nested = [], []
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        name = f"{path}.{field.name}" if path else field.name
        if dataclasses.is_dataclass(value):
            nested += sections(value, name)
            continue
        rows.append((name, str(field.type), shown(value), comments.get(field.name, "")))
    return [(path, rows), *nested]


def reference() -> str:
    """The whole page."""
    parts = [TITLE, "", PREAMBLE]
    for path, rows in sections(RunConfig(), ""):
        if not rows:
            continue
        parts += ["", f"## {path or 'the run'}", "", "| field | type | default | what it is |", "|---|---|---|---|"]
        parts += [f"| `{name}` | `{cell(kind)}` | `{cell(default)}` | {cell(doc)} |" for name, kind, default, doc in rows]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference())
