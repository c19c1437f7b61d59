"""``mqdedup dedup show | forget``: one message id's claim, without writing SQL.

``show`` prints, per consumer that claimed the message id, when it was processed, the
stored result (what a duplicate's ``on_duplicate`` receives), the attempt count of a
message that failed, and the recorded steps (``ctx.step``). ``forget`` deletes one
consumer's claim, its steps and its attempt count in one transaction: the next delivery
or replay of that message runs the handler again (its effects happen again), so it asks
first on a terminal and is refused elsewhere without ``--yes``.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from mqdedup.cli import exitcodes
from mqdedup.cli.admin import connected_engine
from mqdedup.cli.exitcodes import RefusedError
from mqdedup.cli.output import print_json
from mqdedup.db.schema import schema
from mqdedup.dedup.forgetting import forget_claim


def cmd_dedup_show(args: argparse.Namespace) -> int:
    engine, prefix = connected_engine(args)
    claims = claim_data(engine, prefix, args.message_id, args.consumer)
    if args.json:
        print_json(claims)
    elif claims:
        print("\n\n".join(claim_text(claim) for claim in claims))
    else:
        scope = f" by consumer {args.consumer!r}" if args.consumer else ""
        print(f"message id {args.message_id!r} is not claimed{scope}")
    return exitcodes.OK if claims else exitcodes.CHECK_FAILED


def cmd_dedup_forget(args: argparse.Namespace) -> int:
    engine, prefix = connected_engine(args)
    if not claim_data(engine, prefix, args.message_id, args.consumer):
        print(f"message id {args.message_id!r} is not claimed by consumer {args.consumer!r}")
        return exitcodes.CHECK_FAILED
    if not args.yes:
        _confirm_forget(args.message_id, args.consumer)
    removed = forget_claim(engine, prefix, args.consumer, args.message_id)
    print(
        f"forgot message id {args.message_id!r} of consumer {args.consumer!r} "
        f"({removed['claims']} claim, {removed['steps']} step(s), "
        f"{removed['attempts']} attempt count)"
    )
    return exitcodes.OK


def claim_data(
    engine: Engine, prefix: str, message_id: str, consumer: str | None = None
) -> list[dict[str, Any]]:
    """Per consumer that claimed ``message_id``: ``consumer``, ``processed_at``,
    ``result``, ``attempts`` (a failed message's count, or None) and ``steps``."""
    tables = schema(prefix)
    processed, steps, attempts = tables.processed, tables.steps, tables.attempts
    query = select(processed).where(processed.c.message_id == message_id)
    if consumer is not None:
        query = query.where(processed.c.consumer_name == consumer)
    claims: list[dict[str, Any]] = []
    with Session(engine) as session:
        for row in session.execute(query.order_by(processed.c.consumer_name)).mappings():
            name = row["consumer_name"]
            step_rows = session.execute(
                select(steps)
                .where(steps.c.consumer_name == name, steps.c.message_id == message_id)
                .order_by(steps.c.started_at)
            ).mappings()
            count = session.execute(
                select(attempts.c.attempts).where(
                    attempts.c.consumer_name == name, attempts.c.message_id == message_id
                )
            ).scalar_one_or_none()
            claims.append(
                {
                    "consumer": name,
                    "message_id": message_id,
                    "processed_at": _iso(row["processed_at"]),
                    "result": row["result"],
                    "attempts": count,
                    "steps": [
                        {
                            "name": step["name"],
                            "state": step["state"],
                            "attempts": step["attempts"],
                            "result": step["result"],
                            "started_at": _iso(step["started_at"]),
                            "completed_at": _iso(step["completed_at"]),
                        }
                        for step in step_rows
                    ],
                }
            )
    return claims


def claim_text(claim: dict[str, Any]) -> str:
    """One claim as lines of text."""
    lines = [
        f"consumer: {claim['consumer']}",
        f"message id: {claim['message_id']}",
        f"processed at: {claim['processed_at']}",
        f"stored result: {_json(claim['result'])}",
    ]
    if claim["attempts"] is not None:
        lines.append(f"failed attempts: {claim['attempts']}")
    if not claim["steps"]:
        lines.append("steps: none")
    else:
        lines.append("steps:")
        lines.extend(
            f"  {step['name']}: {step['state']} (attempts {step['attempts']}, "
            f"result {_json(step['result'])})"
            for step in claim["steps"]
        )
    return "\n".join(lines)


def _confirm_forget(message_id: str, consumer: str) -> None:
    risk = (
        f"forgetting message id {message_id!r} of consumer {consumer!r} lets its next delivery "
        "or replay run the handler again (its effects happen again)"
    )
    if not sys.stdin.isatty():
        raise RefusedError(f"{risk}; nothing forgotten (pass --yes to confirm)")
    answer = input(f"{risk}. Forget it? [y/N] ")
    if answer.strip().lower() not in ("y", "yes"):
        raise RefusedError("not confirmed; nothing forgotten")


def _json(value: Any) -> str:
    return "none" if value is None else json.dumps(value, sort_keys=True, default=str)


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None
