"""``manage.py mqdedup_worker``: ``mqdedup worker`` on this project's settings (docs/django.md)."""

from __future__ import annotations

import sys
from typing import Any

from django.core.management.base import BaseCommand  # type: ignore[import-untyped]

from mqdedup.django.commands import run_command


class Command(BaseCommand):  # type: ignore[misc]
    help = (
        "mqdedup worker on this project's database (settings.MQDEDUP['DATABASE']); takes "
        "the arguments of `mqdedup worker` (--help lists them)"
    )

    def run_from_argv(self, argv: list[str]) -> None:
        """mqdedup's own parser reads the arguments (exit codes as ``mqdedup worker``)."""
        sys.exit(run_command("worker", argv[2:]))

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("arguments", nargs="*", help="arguments of mqdedup worker")

    def handle(self, *args: Any, **options: Any) -> None:
        """``call_command("mqdedup_worker", "--processes", "2", ...)``."""
        code = run_command("worker", [*args, *options.get("arguments", [])])
        if code:
            sys.exit(code)
