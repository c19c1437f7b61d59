"""mkdocs hooks: the repository's Markdown outside ``docs/`` joins the site, links checked.

The pages link to files outside ``docs/`` (``../examples/order_service/README.md``,
``../CONTRIBUTING.md``, a benchmark plot). :data:`SITE_FILES` adds those files to the
site under their repository path, and every relative link is rewritten from its
repository form to its site form. A link whose target does not exist in the repository
is a warning, so ``mkdocs build --strict`` fails on it; a link to a repository file that
is not part of the site (a source file) becomes plain text naming the path.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.plugins.mqdedup_links")

REPO = Path(__file__).resolve().parent.parent
#: Repository files (globs) that are pages or assets of the site besides ``docs/``.
SITE_FILES = (
    "CONTRIBUTING.md",
    "examples/README.md",
    "examples/*/README.md",
    "bench/results/results.md",
    "bench/results/*.png",
)
_LINK = re.compile(
    r"(?P<bang>!?)\[(?P<text>[^\]]*)\]\((?P<target>[^)\s#]*)(?P<anchor>#[^)\s]*)?"
    r"(?P<title>\s+\"[^\"]*\")?\)"
)
_FENCE = re.compile(r"^(\s{0,3})(`{3,}|~{3,})", re.M)


def on_files(files: Files, config: Any) -> Files:
    """Add :data:`SITE_FILES` under their repository paths."""
    for pattern in SITE_FILES:
        for path in sorted(REPO.glob(pattern)):
            relative = path.relative_to(REPO).as_posix()
            files.append(
                File(
                    relative,
                    src_dir=str(REPO),
                    dest_dir=config["site_dir"],
                    use_directory_urls=config["use_directory_urls"],
                )
            )
    return files


def _repo_path(page_src: str) -> str:
    """The repository path of a page: ``concepts.md`` -> ``docs/concepts.md``."""
    for pattern in SITE_FILES:
        if Path(page_src).match(pattern) and (REPO / page_src).is_file():
            return page_src
    return f"docs/{page_src}"


def _site_path(repo_path: str, site: set[str]) -> str | None:
    if repo_path.startswith("docs/") and repo_path[5:] in site:
        return repo_path[5:]
    return repo_path if repo_path in site else None


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Rewrite repository-relative links to site-relative ones; warn on missing targets."""
    site = {file.src_uri for file in files}
    page_src = page.file.src_uri
    page_repo = _repo_path(page_src)

    def rewrite(match: re.Match[str]) -> str:
        target = match["target"]
        if not target or re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
            return match.group(0)
        repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(page_repo), target))
        if repo_path.startswith("..") or not (REPO / repo_path).exists():
            log.warning("%s links to %s, which does not exist in the repository", page_repo, target)
            return match.group(0)
        site_path = _site_path(repo_path, site)
        if site_path is None and (REPO / repo_path).is_dir():
            site_path = _site_path(posixpath.join(repo_path, "README.md"), site)
        if site_path is None:  # a source file, not a page: named, not linked out of the site
            return f"{match['text']} (`{repo_path}`)"
        relative = posixpath.relpath(site_path, posixpath.dirname(page_src) or ".")
        return (
            f"{match['bang']}[{match['text']}]({relative}{match['anchor'] or ''}"
            f"{match['title'] or ''})"
        )

    parts = _FENCE.split(markdown)
    out: list[str] = []
    inside = False
    # split keeps the two captured groups of each fence: (indent, fence) pairs
    index = 0
    while index < len(parts):
        chunk = parts[index]
        if not inside:
            chunk = _LINK.sub(rewrite, chunk)
        out.append(chunk)
        if index + 2 < len(parts):
            out.append(parts[index + 1] + parts[index + 2])
            inside = not inside
        index += 3
    return "".join(out)
