"""One suite of ``python -m bench`` on two source trees, side by side in one run:
``python -m bench.compare_trees BEFORE_TREE AFTER_TREE [--suite handlers] [--rounds 3]``.

A tree is a checkout of mqdedup (e.g. ``git worktree add /tmp/before <rev>``). The suite
runs alternately on each tree (``PYTHONPATH=<tree>``, one run per round, so drift in the
machine's load falls on both sides alike), and the medians of the rounds are printed per
row with the ratio after/before. Rows whose ratio is below ``--budget`` (default 0.95:
more than 5 % slower) are marked. For the handlers suite the issue's goals follow, as
the median over rounds of each round's ratio (a row and its reference ran in the same
process, interleaved, so the machine's load falls on both alike).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

LINE = re.compile(r"\] \w+ run \d+: (?P<name>.+): (?P<rate>[\d,]+) \(")


def run_once(tree: Path, suite: str, out: Path) -> dict[str, float]:
    """One run of ``suite`` on ``tree``: messages per second by row."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, "-m", "bench", "--only", suite, "--runs", "1"]
    command += ["--out", str(out), "--no-docs"]
    # check=False: the suite prints its figures before drawing charts (matplotlib, the
    # bench extra), which may fail without changing them.
    result = subprocess.run(command, check=False, cwd=tree, env=env, capture_output=True, text=True)
    rates = {
        match["name"]: float(match["rate"].replace(",", ""))
        for match in LINE.finditer(result.stdout + result.stderr)
    }
    if not rates:
        raise SystemExit(f"no figures from {tree}:\n{result.stdout}\n{result.stderr}")
    return rates


def main(argv: list[str] | None = None) -> int:
    """Print the medians side by side; 1 when a row is slower than the budget."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--suite", default="handlers")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.95)
    args = parser.parse_args(argv)
    figures: dict[str, dict[str, list[float]]] = {"before": defaultdict(list)}
    rounds: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    figures["after"] = defaultdict(list)
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for side, tree in (("before", args.before), ("after", args.after)):
                rates = run_once(tree.resolve(), args.suite, Path(scratch))
                rounds[side].append(rates)
                for name, rate in rates.items():
                    figures[side][name].append(rate)
            print(f"round {round_ + 1} of {args.rounds} done", file=sys.stderr)
    slower = False
    print(f"{'row':<62} {'before':>9} {'after':>9} {'after/before':>12}")
    for name, values in figures["before"].items():
        before = statistics.median(values)
        after_values = figures["after"].get(name)
        if not after_values:
            continue
        after = statistics.median(after_values)
        ratio = after / before
        mark = "  <- over budget" if ratio < args.budget else ""
        slower = slower or bool(mark)
        print(f"{name[:62]:<62} {before:>9,.0f} {after:>9,.0f} {ratio:>12.3f}{mark}")
    if args.suite == "handlers":
        print_goals(rounds)
    return 1 if slower else 0


def print_goals(rounds: dict[str, list[dict[str, float]]]) -> None:
    """The handlers suite's goals: per side, the median of the per-round ratios."""
    from bench.suite_handlers import GOALS

    print(f"\n{'goal (median of per-round ratios)':<62} {'before':>9} {'after':>9}")
    for row, reference, label in GOALS:
        shown = []
        for side in ("before", "after"):
            values = [r[row] / r[reference] for r in rounds[side] if row in r and reference in r]
            shown.append(f"{statistics.median(values):>9.2f}" if values else f"{'-':>9}")
        print(f"{label[:62]:<62} {' '.join(shown)}")


if __name__ == "__main__":
    sys.exit(main())
