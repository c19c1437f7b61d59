"""Print the modules of a package with their line counts, per package and on average.

    python scripts/module_sizes.py                  # mqdedup/, a Markdown table
    python scripts/module_sizes.py --sort lines     # largest first
    python scripts/module_sizes.py --ref main       # the same table for a git revision

Lines are physical lines (blank lines and comments included), as ``wc -l`` counts them;
empty ``__init__.py`` files are left out. Used for the before/after table of a redesign.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def sizes_in_tree(root: Path) -> dict[str, int]:
    """``{path relative to the repository: lines}`` of every ``.py`` file under ``root``."""
    found: dict[str, int] = {}
    for path in sorted(root.rglob("*.py")):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines:
            found[path.relative_to(REPO).as_posix()] = lines
    return found


def sizes_at_revision(revision: str, package: str) -> dict[str, int]:
    """The same as :func:`sizes_in_tree` for ``package`` at a git revision."""
    listing = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", revision, package],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    found: dict[str, int] = {}
    for name in sorted(n for n in listing if n.endswith(".py")):
        text = subprocess.run(
            ["git", "show", f"{revision}:{name}"],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        lines = len(text.splitlines())
        if lines:
            found[name] = lines
    return found


def table(sizes: dict[str, int], *, sort: str) -> str:
    """A Markdown table: one row per module, then one per package, then the totals."""
    rows = sorted(sizes.items(), key=lambda item: -item[1]) if sort == "lines" else sizes.items()
    out = ["| module | lines |", "|---|---:|"]
    out += [f"| `{name}` | {lines} |" for name, lines in rows]
    packages: dict[str, list[int]] = defaultdict(list)
    for name, lines in sizes.items():
        packages[str(Path(name).parent)].append(lines)
    out += ["", "| package | modules | lines | average |", "|---|---:|---:|---:|"]
    for package, counts in sorted(packages.items()):
        average = sum(counts) / len(counts)
        out.append(f"| `{package}/` | {len(counts)} | {sum(counts)} | {average:.0f} |")
    total = sum(sizes.values())
    average = total / len(sizes) if sizes else 0.0
    out += ["", f"**{len(sizes)} modules, {total} lines, average {average:.0f} lines per module**"]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--package", default="mqdedup", help="folder to measure (default mqdedup)")
    parser.add_argument("--ref", help="a git revision to measure instead of the work tree")
    parser.add_argument("--sort", choices=("name", "lines"), default="name")
    args = parser.parse_args(argv)
    if args.ref:
        sizes = sizes_at_revision(args.ref, args.package)
    else:
        root = REPO / args.package
        if not root.is_dir():
            print(f"module_sizes: no folder {args.package!r} in {REPO}", file=sys.stderr)
            return 2
        sizes = sizes_in_tree(root)
    print(table(sizes, sort=args.sort))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
