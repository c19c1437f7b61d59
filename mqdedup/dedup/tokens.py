"""One-time tokens: ``issue(owner, ttl)`` and ``consume(owner, token)``.

A one-time token guards an action that has no natural message id (a form submit, a
payment confirmation link, a client-side retry key): the client asks for a token, then
sends it with the action; the first consume wins and every other attempt gets a
distinct answer, so clients know whether to retry with a new token:

* ``consumed`` — this call used the token: perform the action;
* ``already used`` — a repeat (double click, retry, replay): do not perform it again;
* ``expired`` — the token's time ran out unused: get a new token;
* ``unknown`` — never issued, purged, malformed, or issued to *another owner* (the
  answer does not reveal that the token exists).

Tokens are bound to their owner (a user id, an API client, a tenant...). Consuming is
one atomic statement::

    UPDATE tokens SET used_at = :now
     WHERE token_hash = :h AND owner = :owner AND used_at IS NULL AND expires_at > :now

and only when it matched no row a read of the token says which of the other answers
applies. Concurrent consumers of one token serialise on its row: exactly one is
``consumed``, the rest ``already used``.

Backends: :class:`DatabaseTokenStore` (default; the ``<prefix>tokens`` table, and it can
share the caller's business transaction so the action and the consume commit together)
and :class:`mqdedup.dedup.redis_tokens.RedisTokenStore` (the ``redis`` extra).

Only a SHA-256 of each token is stored: the table does not hold usable secrets.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Protocol, runtime_checkable

from sqlalchemy import Engine, delete, insert, select, update
from sqlalchemy.orm import Session, sessionmaker

from mqdedup.db import dialects
from mqdedup.db.engine import session_factory
from mqdedup.db.schema import DEFAULT_PREFIX, schema
from mqdedup.dedup.store import aware, utcnow
from mqdedup.errors import ConfigurationError

log = logging.getLogger(__name__)

#: Longest owner accepted (the column is VARCHAR(255)).
MAX_OWNER_LENGTH = 255
#: Tokens longer than this are not ours: answered ``unknown`` without a query.
MAX_TOKEN_LENGTH = 512
#: The longest ttl accepted (10 years): expiries must stay representable everywhere.
MAX_TTL_SECONDS = 10 * 365 * 24 * 3600.0
_TOKEN_BYTES = 32  # 256 bits of randomness, 43 URL-safe characters
_ISSUE_ATTEMPTS = 3


class TokenOutcome(StrEnum):
    """The answer of :meth:`TokenStore.consume`."""

    CONSUMED = "consumed"
    ALREADY_USED = "already used"
    EXPIRED = "expired"
    UNKNOWN = "unknown"


@runtime_checkable
class TokenStore(Protocol):
    """What every one-time-token backend offers."""

    def issue(self, owner: str, ttl: timedelta | float) -> str:
        """A new token for ``owner``, valid for ``ttl`` (seconds or a timedelta)."""
        ...

    def consume(self, owner: str, token: str) -> TokenOutcome:
        """Use ``token`` once for ``owner``; see :class:`TokenOutcome`."""
        ...


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(_TOKEN_BYTES)


def token_hash(token: str) -> str:
    """What the stores keep instead of the token: its SHA-256, hex."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def check_owner(owner: str) -> str:
    """Return ``owner`` if usable, else raise ValueError naming the problem.

    Checked before any database or Redis sees it, so every backend gives the same
    answer (PostgreSQL alone would refuse a NUL with a raw DataError).
    """
    if not isinstance(owner, str) or not owner:
        raise ValueError("token owner must be a non-empty string")
    if len(owner) > MAX_OWNER_LENGTH:
        raise ValueError(f"token owner longer than {MAX_OWNER_LENGTH} characters")
    if "\x00" in owner:
        raise ValueError("token owner must not contain NUL (\\x00) characters")
    try:
        owner.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"token owner is not valid Unicode text (a lone surrogate at {exc.start})"
        ) from None
    return owner


def ttl_seconds(ttl: timedelta | float) -> float:
    """``ttl`` in seconds; raise ValueError unless it is positive and at most 10 years."""
    try:
        seconds = ttl.total_seconds() if isinstance(ttl, timedelta) else float(ttl)
    except (TypeError, ValueError):
        raise ValueError(f"token ttl must be seconds or a timedelta, got {ttl!r}") from None
    if not 0 < seconds <= MAX_TTL_SECONDS:
        raise ValueError(
            f"token ttl must be positive and at most {MAX_TTL_SECONDS:.0f} seconds "
            f"(10 years), got {ttl!r}"
        )
    return seconds


def plausible_token(token: object) -> bool:
    """False for values that cannot be a token we issued (no lookup needed).

    Issued tokens are URL-safe ASCII: anything else (NUL, surrogates, other text) is
    ``unknown`` on every backend without reaching it.
    """
    return (
        isinstance(token, str)
        and 0 < len(token) <= MAX_TOKEN_LENGTH
        and token.isascii()
        and "\x00" not in token
    )


class DatabaseTokenStore:
    """One-time tokens in the ``<prefix>tokens`` table.

    ``database`` (an engine or a session factory) is used when a call gets no
    ``session``: the call then runs in its own short transaction. Pass ``session=`` to
    run inside the caller's transaction instead, e.g. in a handler with ``ctx.session``,
    so that the consume commits or rolls back together with the action it guards.

    Expiry compares with this process's UTC clock; keep the clocks of the machines that
    issue and consume tokens in sync (NTP), or use generous ttls.
    """

    def __init__(
        self,
        database: Engine | sessionmaker[Session] | None = None,
        *,
        prefix: str = DEFAULT_PREFIX,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.table = schema(prefix).tokens
        self._sessions = session_factory(database) if isinstance(database, Engine) else database
        self._clock = clock

    def _now(self) -> datetime:
        return aware(self._clock())

    @contextmanager
    def _transaction(self, session: Session | None) -> Iterator[Session]:
        if session is not None:
            yield session
            return
        if self._sessions is None:
            raise ConfigurationError(
                "DatabaseTokenStore has no database: pass an engine when creating it, "
                "or session= to each call"
            )
        with self._sessions() as own, own.begin():
            yield own

    def issue(self, owner: str, ttl: timedelta | float, *, session: Session | None = None) -> str:
        """Create a token for ``owner`` valid for ``ttl``; return it (only its hash is kept)."""
        check_owner(owner)
        lifetime = timedelta(seconds=ttl_seconds(ttl))
        for _ in range(_ISSUE_ATTEMPTS):
            token = new_token()
            now = self._now()
            row = {
                "token_hash": token_hash(token),
                "owner": owner,
                "issued_at": now,
                "expires_at": now + lifetime,
                "used_at": None,
            }
            try:
                if session is None:
                    with self._transaction(None) as own:
                        own.execute(insert(self.table).values(row))
                else:
                    # A savepoint, so that the (astronomically unlikely) collision of two
                    # random 256-bit tokens does not abort the caller's transaction.
                    with session.begin_nested():
                        session.execute(insert(self.table).values(row))
            except Exception as error:
                if dialects.is_unique_violation(error):
                    continue
                raise
            return token
        raise RuntimeError("could not issue a unique token")  # pragma: no cover

    def consume(self, owner: str, token: str, *, session: Session | None = None) -> TokenOutcome:
        """Use ``token`` once for ``owner`` (one atomic UPDATE); see :class:`TokenOutcome`."""
        check_owner(owner)
        if not plausible_token(token):
            return TokenOutcome.UNKNOWN
        hashed = token_hash(token)
        now = self._now()
        with self._transaction(session) as active:
            for _ in range(2):
                outcome = self._consume_once(active, owner, hashed, now)
                if outcome is not None:
                    return outcome
        # Still unused, live and ours although the UPDATE matched nothing twice: a
        # concurrent use kept rolling back. Nothing was consumed by this call.
        log.warning("token consume kept racing; not consumed", extra={"owner": owner})
        return TokenOutcome.UNKNOWN

    def _consume_once(
        self, session: Session, owner: str, hashed: str, now: datetime
    ) -> TokenOutcome | None:
        table = self.table
        result = session.execute(
            update(table)
            .where(
                table.c.token_hash == hashed,
                table.c.owner == owner,
                table.c.used_at.is_(None),
                table.c.expires_at > now,
            )
            .values(used_at=now)
        )
        if result.rowcount == 1:  # type: ignore[attr-defined]
            return TokenOutcome.CONSUMED
        found = session.execute(
            dialects.latest_committed(
                select(table.c.owner, table.c.expires_at, table.c.used_at).where(
                    table.c.token_hash == hashed
                )
            )
        ).first()
        if found is None or found.owner != owner:
            return TokenOutcome.UNKNOWN
        if found.used_at is not None:
            return TokenOutcome.ALREADY_USED
        if aware(found.expires_at) <= now:
            return TokenOutcome.EXPIRED
        # Unused, live and ours: it was issued (committed) between our two statements,
        # or a concurrent use rolled back in between. Try the UPDATE again.
        return None

    def purge(self, older_than: timedelta = timedelta(days=7), chunk_size: int = 5000) -> int:
        """Delete tokens that expired more than ``older_than`` ago, in short transactions.

        Until purged, a used token answers ``already used`` and an expired one
        ``expired``; afterwards both answer ``unknown``. Returns the rows deleted.
        """
        if self._sessions is None:
            raise ConfigurationError("DatabaseTokenStore.purge needs an engine")
        cutoff = self._now() - older_than
        table = self.table
        total = 0
        while True:
            with self._sessions() as session, session.begin():
                hashes = list(
                    session.scalars(
                        select(table.c.token_hash)
                        .where(table.c.expires_at < cutoff)
                        .limit(chunk_size)
                    )
                )
                if hashes:
                    session.execute(delete(table).where(table.c.token_hash.in_(hashes)))
            total += len(hashes)
            if len(hashes) < chunk_size:
                log.info("purged tokens", extra={"deleted": total, "cutoff": cutoff.isoformat()})
                return total
