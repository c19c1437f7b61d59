"""The implementations of the ``mqdedup`` sub-commands (the parser lives in mqdedup.cli.main)."""

from __future__ import annotations

from mqdedup.errors import MqdedupError


class RefusedError(MqdedupError):
    """A safety check refused an action that could lose protection or data.

    Exit code 1 (``CHECK_FAILED``); the message names the flag that overrides it
    (``--yes``, ``--force``, ``--allow-reprocess``).
    """
