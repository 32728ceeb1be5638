"""MkDocs hook: links from a docs page to a file of the repository outside docs/.

A page links to such a file as GitHub reads it: relative to the page (`../README.md`) or from the repository's root
(`/configs/mt10.yaml`). MkDocs resolves links among the files under `docs_dir` alone, so under `strict` such a link
would fail the build while it works on GitHub. This hook checks each one instead: a link to a file the repository does
not hold is a warning, which `strict` turns into a failed build as it does for a broken link between pages; a link to
a file it holds points at a copy of that file in the built site (`repository/<path>`). Links between pages are left to
MkDocs' own checks.
"""

from __future__ import annotations

import posixpath
import re
import shutil
from pathlib import Path

from mkdocs.plugins import get_plugin_logger
from mkdocs.utils import get_relative_url

log = get_plugin_logger("repository_links")

# A Markdown link or image target: `](target)` or `](target "title")`, the target without spaces.
LINK = re.compile(r"\]\((?P<target>[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^[ \t]*(```|~~~)", re.MULTILINE)
SCHEME = "repository:"
COPY_ROOT = "repository"

_copied: set[str] = set()


def _repository_path(target: str, page_src_uri: str, docs_dir: Path, root: Path) -> str | None:
    """The repository-relative path a link names when it leaves docs/, or None for a link MkDocs checks itself."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith(("#", "//")):
        return None  # a URL, a mail address, an anchor on the same page
    path = target.split("#", 1)[0].split("?", 1)[0]
    if not path:
        return None
    docs = docs_dir.resolve().relative_to(root.resolve()).as_posix()
    if path.startswith("/"):
        joined = posixpath.normpath(path.lstrip("/"))
    else:
        joined = posixpath.normpath(posixpath.join(docs, posixpath.dirname(page_src_uri), path))
    if joined == docs or joined.startswith(docs + "/"):
        return None  # inside docs/: MkDocs resolves and checks it
    return joined


def _rewrite(text: str, page_src_uri: str, docs_dir: Path, root: Path) -> str:
    def replace(match: re.Match[str]) -> str:
        target = match.group("target")
        path = _repository_path(target, page_src_uri, docs_dir, root)
        if path is None:
            return match.group(0)
        if path.startswith("../") or not (root / path).is_file():
            log.warning(f"Doc file '{page_src_uri}' contains a link '{target}', but the repository holds no file '{path}'.")
            return match.group(0)
        _copied.add(path)
        anchor = target[len(target.split("#", 1)[0]) :]
        return f"]({SCHEME}{path}{anchor}{match.group('title') or ''})"

    # Fenced code blocks are left alone: the split puts each fence's marker between the parts it separates.
    parts = FENCE.split(text)
    out, inside = [], False
    for index, part in enumerate(parts):
        if index % 2:  # a fence's marker
            inside = not inside
            out.append(part)
        else:
            out.append(part if inside else LINK.sub(replace, part))
    return "".join(out)


def on_pre_build(config, **kwargs):
    _copied.clear()


def on_page_markdown(markdown, page, config, files, **kwargs):
    docs_dir = Path(config["docs_dir"])
    root = Path(config["config_file_path"]).parent
    return _rewrite(markdown, page.file.src_uri, docs_dir, root)


def on_page_content(html, page, config, files, **kwargs):
    # The placeholder scheme kept MkDocs' link checks off these links; now they point at the copies in the site.
    def href(match: re.Match[str]) -> str:
        path, _, anchor = match.group(2).partition("#")
        url = get_relative_url(f"{COPY_ROOT}/{path}", page.url or ".")
        return f'{match.group(1)}="{url}{"#" + anchor if anchor else ""}"'

    return re.sub(r'(href|src)="' + re.escape(SCHEME) + r'([^"]*)"', href, html)


def on_post_build(config, **kwargs):
    root = Path(config["config_file_path"]).parent
    site = Path(config["site_dir"])
    for path in sorted(_copied):
        destination = site / COPY_ROOT / path
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / path, destination)
