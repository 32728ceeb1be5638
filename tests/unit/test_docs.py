"""The docs as MkDocs builds them (mkdocs.yml; docs/decisions.md, "The docs: MkDocs, built strictly"): the strict
build passes, a broken link or anchor fails it, and every guide page stays short enough to read in minutes."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
GUIDE_MAX_LINES = 300


def build_strictly(root: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` of the mkdocs.yml in root, the site written to site."""
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)]
    return subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=300)


def test_the_docs_build_strictly(tmp_path: Path) -> None:
    """Every page in the nav, every nav entry a page, every link and anchor found: a warning fails a strict build."""
    result = build_strictly(REPO, tmp_path / "site")
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}{result.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


@pytest.mark.parametrize(
    ("old", "new", "named"),
    [
        ("](records/suites.md#", "](records/no_such_page.md#", "records/no_such_page.md"),
        ("](records/suites.md#", "](records/suites.md#no-such-heading-", "#no-such-heading-"),
    ],
    ids=["page", "anchor"],
)
def test_a_broken_link_fails_the_strict_build(tmp_path: Path, old: str, new: str, named: str) -> None:
    """A copy of the docs with one link broken (its page, or its anchor) does not build, and the output names it."""
    root = tmp_path / "repo"
    shutil.copytree(DOCS, root / "docs")
    for name in ("mkdocs.yml", "mkdocs_hooks.py", "README.md"):
        shutil.copy(REPO / name, root / name)
    guide = root / "docs" / "suites.md"
    text = guide.read_text()
    assert old in text, f"docs/suites.md no longer links with {old!r}: break another link"
    guide.write_text(text.replace(old, new, 1))

    result = build_strictly(root, tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode != 0, f"the build passed with a broken link:\n{output}"
    assert named in output, output


def test_every_guide_page_is_at_most_300_lines() -> None:
    """The guides (docs/*.md) are read in minutes; the measurements behind them go to docs/records/."""
    guides = sorted(DOCS.glob("*.md"))
    assert guides
    lengths = {page.name: len(page.read_text().splitlines()) for page in guides}
    too_long = {name: n for name, n in lengths.items() if n > GUIDE_MAX_LINES}
    assert not too_long, f"guide pages over {GUIDE_MAX_LINES} lines (move the history to docs/records/): {too_long}"
