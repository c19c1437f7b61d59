"""``mqdedup console``: the operator's web page, served by the CLI.

Server-rendered pages (no script, no build step) over the framework's tables and the
dead-letter places of :mod:`mqdedup.deadletters`: an overview (throughput from the
claims, lag, dead letters, the outbox and relay leases), dead letters grouped by
consumer and error with replay / requeue / delete, claims (look up, forget) and failed
outbox rows (retry). Safe by default: loopback unless credentials are given, every
action a CSRF-checked POST written to ``<prefix>audit``, ``--read-only``, everything
escaped under a Content-Security-Policy without script. See ``docs/console.md``.
"""

from mqdedup.console.app import ConsoleApp
from mqdedup.console.server import ConsoleServer
from mqdedup.console.web import ConsoleSettings

__all__ = ["ConsoleApp", "ConsoleServer", "ConsoleSettings"]
