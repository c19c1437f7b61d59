"""Conditional state transitions: idempotent status changes without a message id.

Declare the allowed edges of a state column once, then move rows along them::

    orders_flow = StateMachine(
        Order,                      # a mapped class, or a Table
        {"CREATED": {"PAID", "CLOSED"}, "PAID": {"REFUNDED"}},
        state_column="status",
    )

    result = orders_flow.transition(ctx.session, order_id, to="PAID")
    if result.applied:
        ctx.outbox.publish("order-paid", {...})   # side effects only when applied

Each call runs exactly one conditional statement::

    UPDATE orders SET status = 'PAID' WHERE id = :id AND status IN ('CREATED')

and reads the affected-row count. Only when no row matched does it read the current
state (a locking read of the latest committed version) to tell the caller why:

* ``applied`` — this call moved the row;
* ``already in target state`` — an idempotent repeat (a redelivery, a retry, a
  concurrent twin that won the race);
* ``rejected: illegal from STATE`` — the row is in a state the graph does not allow
  the move from (e.g. ``REFUNDED`` → ``PAID``);
* ``stale version`` — with a version column and ``expected_version``, the row moved on;
* ``not found`` — no row has that id.

A target state that no edge leads to, or a ``from_`` → ``to`` pair that is not an edge,
raises :class:`IllegalTransitionError` before any SQL is sent.

Concurrency: the row lock taken by the ``UPDATE`` serialises concurrent callers. The
winner's commit makes every waiting ``UPDATE`` re-check its condition against the new
state (PostgreSQL READ COMMITTED, InnoDB locking reads), so they match 0 rows and
report ``already in target state``. Under PostgreSQL REPEATABLE READ / SERIALIZABLE
the losers get a serialization failure instead, and InnoDB (MySQL/MariaDB) may report a
deadlock (error 1213) when many transactions queue on one row: both are transient, and
the consumer's processor reruns the transaction. Outside a consumer (a web request),
run the transaction with :func:`run_transaction`, which does the same.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from sqlalchemy import Column, Engine, Table, inspect, select, update
from sqlalchemy.exc import NoInspectionAvailable
from sqlalchemy.orm import Mapper, Session, sessionmaker

from mqdedup.backoff import Backoff
from mqdedup.db.dialects import is_transient, latest_committed
from mqdedup.db.engine import session_factory
from mqdedup.errors import ConfigurationError, MqdedupError

log = logging.getLogger(__name__)
T = TypeVar("T")

# A row whose state is a valid source yet the UPDATE matched nothing can only come from
# a concurrent change between the two statements (a cycle in the graph); retry a little.
_MAX_RACE_RETRIES = 3


class IllegalTransitionError(MqdedupError):
    """The requested transition is not on the state machine's graph (no SQL was run)."""


class TransitionOutcome(StrEnum):
    """What a :meth:`StateMachine.transition` call found."""

    APPLIED = "applied"
    ALREADY_IN_TARGET = "already in target state"
    REJECTED = "rejected"
    STALE = "stale version"
    NOT_FOUND = "not found"


@dataclass(frozen=True, slots=True)
class TransitionResult:
    """The outcome of one transition call.

    ``current_state`` is the row's state after the call: the target when applied or
    already there, the blocking state when rejected, ``None`` when not found.
    ``version`` is the row's version after the call when a version column is declared
    and it is known (read on 0 rows, or ``expected_version + 1`` when applied).
    """

    outcome: TransitionOutcome
    target: str
    current_state: str | None
    version: int | None = None

    @property
    def applied(self) -> bool:
        """True when this call changed the row (do the side effects now)."""
        return self.outcome is TransitionOutcome.APPLIED

    @property
    def already_in_target(self) -> bool:
        """True for an idempotent repeat: the row was already in the target state."""
        return self.outcome is TransitionOutcome.ALREADY_IN_TARGET

    @property
    def rejected(self) -> bool:
        """True when the graph forbids the move from the row's current state."""
        return self.outcome is TransitionOutcome.REJECTED

    @property
    def ok(self) -> bool:
        """True when the row is in the target state now (applied or already there)."""
        return self.applied or self.already_in_target

    def __str__(self) -> str:
        if self.outcome is TransitionOutcome.REJECTED:
            return f"rejected: illegal from {self.current_state}"
        if self.outcome is TransitionOutcome.STALE:
            return f"stale version: row is at version {self.version} in {self.current_state}"
        return self.outcome.value


class StateMachine:
    """The allowed edges of one state column, and the transition operation.

    ``target`` is a mapped class (ORM) or a :class:`~sqlalchemy.Table`. ``edges`` maps
    each state to the states it may move to. ``id_column`` names the column the row id
    is compared with (default: the single primary-key column). ``version_column``, if
    given, is incremented by every applied transition and can be checked with
    ``expected_version`` (optimistic locking).
    """

    def __init__(
        self,
        target: Any,
        edges: Mapping[str, Iterable[str]],
        *,
        state_column: str = "state",
        id_column: str | None = None,
        version_column: str | None = None,
    ) -> None:
        self.mapper: Mapper[Any] | None = _mapper_of(target)
        self.table: Table = _table_of(target, self.mapper)
        self.edges: dict[str, frozenset[str]] = _validated_edges(edges)
        self.states: frozenset[str] = frozenset(self.edges).union(*self.edges.values())
        self.sources: dict[str, frozenset[str]] = {
            state: frozenset(src for src, targets in self.edges.items() if state in targets)
            for state in self.states
        }
        self.state_column = self._column(state_column, "state_column")
        self.id_column = self._id_column(id_column)
        self.version_column = (
            self._column(version_column, "version_column") if version_column else None
        )

    # -- declaration helpers -----------------------------------------------------------

    def _column(self, name: str, what: str) -> Column[Any]:
        column = self.table.c.get(name)
        if column is None:
            raise ConfigurationError(
                f"StateMachine {what}: table {self.table.name} has no column {name!r}"
            )
        return column

    def _id_column(self, name: str | None) -> Column[Any]:
        if name is not None:
            return self._column(name, "id_column")
        primary_key = list(self.table.primary_key.columns)
        if len(primary_key) != 1:
            raise ConfigurationError(
                f"StateMachine: table {self.table.name} has no single-column primary key; "
                "pass id_column="
            )
        return primary_key[0]

    def can(self, source: str, target: str) -> bool:
        """True when ``source`` → ``target`` is an edge of the graph."""
        return target in self.edges.get(source, frozenset())

    def __repr__(self) -> str:
        edges = ", ".join(
            f"{src}->{dst}"
            for src, targets in sorted(self.edges.items())
            for dst in sorted(targets)
        )
        return f"StateMachine({self.table.name}.{self.state_column.name}: {edges})"

    # -- the operation -----------------------------------------------------------------

    def transition(
        self,
        session: Session,
        row: Any,
        to: str,
        *,
        from_: str | Iterable[str] | None = None,
        expected_version: int | None = None,
        values: Mapping[str, Any] | None = None,
    ) -> TransitionResult:
        """Move the row ``row`` (an id, or a mapped instance) to state ``to``.

        ``from_`` narrows the allowed source states (each must be an edge to ``to``).
        ``values`` are extra columns set together with the state (e.g. ``paid_at``).
        Runs in the caller's transaction; see the module docstring for the outcomes.
        """
        sources = self._sources_for(to, from_)
        row_id = self._row_id(row)
        extra = dict(values or {})
        unknown = [name for name in extra if name not in self.table.c]
        if unknown:
            raise ConfigurationError(
                f"transition values: table {self.table.name} has no column(s) {unknown}"
            )
        for _ in range(_MAX_RACE_RETRIES):
            matched = self._conditional_update(
                session, row_id, to, sources, expected_version, extra
            )
            if matched == 1:
                self._expire_identity(session, row_id)
                version = expected_version + 1 if expected_version is not None else None
                log.debug(
                    "transition applied",
                    extra={"table": self.table.name, "row_id": str(row_id), "to": to},
                )
                return TransitionResult(TransitionOutcome.APPLIED, to, to, version)
            if matched > 1:
                raise ConfigurationError(
                    f"StateMachine: {matched} rows of {self.table.name} have "
                    f"{self.id_column.name} = {row_id!r}; the id column must be unique"
                )
            result = self._explain(session, row_id, to, sources, expected_version)
            if result is not None:
                return result
        raise RuntimeError(
            f"transition of {self.table.name} {row_id!r} to {to} kept racing with "
            "concurrent changes; retry the transaction"
        )

    def _sources_for(self, to: str, from_: str | Iterable[str] | None) -> frozenset[str]:
        if to not in self.states:
            raise IllegalTransitionError(
                f"unknown target state {to!r} for {self.table.name}.{self.state_column.name} "
                f"(states: {', '.join(sorted(self.states))})"
            )
        allowed = self.sources[to]
        if not allowed:
            raise IllegalTransitionError(
                f"no transition leads to {to!r} in {self.table.name}.{self.state_column.name}"
            )
        if from_ is None:
            return allowed
        wanted = frozenset([from_] if isinstance(from_, str) else from_)
        illegal = sorted(wanted - allowed)
        if illegal or not wanted:
            raise IllegalTransitionError(
                f"illegal transition {', '.join(illegal) or '(none)'} -> {to} in "
                f"{self.table.name}.{self.state_column.name}"
            )
        return wanted

    def _row_id(self, row: Any) -> Any:
        if self.mapper is not None and isinstance(row, self.mapper.class_):
            identity = self.mapper.primary_key_from_instance(row)
            if len(identity) != 1 or identity[0] is None:
                raise ConfigurationError(
                    f"{type(row).__name__} instance has no single primary-key value yet"
                )
            if self.id_column is not self.mapper.primary_key[0]:
                return getattr(row, self.mapper.get_property_by_column(self.id_column).key)
            return identity[0]
        if row is None:
            raise ConfigurationError(f"transition of {self.table.name}: row id is None")
        return row

    def _conditional_update(
        self,
        session: Session,
        row_id: Any,
        to: str,
        sources: frozenset[str],
        expected_version: int | None,
        extra: Mapping[str, Any],
    ) -> int:
        conditions = [self.id_column == row_id, self.state_column.in_(sorted(sources))]
        new_values: dict[str, Any] = {**extra, self.state_column.name: to}
        if self.version_column is not None:
            new_values[self.version_column.name] = self.version_column + 1
            if expected_version is not None:
                conditions.append(self.version_column == expected_version)
        elif expected_version is not None:
            raise ConfigurationError(
                f"expected_version given but {self.table.name} has no version_column declared"
            )
        statement = update(self.table).where(*conditions).values(new_values)
        if self.mapper is not None:
            session.flush()  # pending ORM changes to the row must reach the database first
        result = session.execute(statement)
        return int(result.rowcount)  # type: ignore[attr-defined]

    def _explain(
        self,
        session: Session,
        row_id: Any,
        to: str,
        sources: frozenset[str],
        expected_version: int | None,
    ) -> TransitionResult | None:
        """After 0 rows: read the latest committed state and say why (None: raced, retry)."""
        columns: list[Column[Any]] = [self.state_column]
        if self.version_column is not None:
            columns.append(self.version_column)
        found = session.execute(
            latest_committed(select(*columns).where(self.id_column == row_id))
        ).first()
        if found is None:
            return TransitionResult(TransitionOutcome.NOT_FOUND, to, None)
        state = found[0]
        version = int(found[1]) if self.version_column is not None else None
        if state == to:
            return TransitionResult(TransitionOutcome.ALREADY_IN_TARGET, to, state, version)
        if state not in sources:
            return TransitionResult(TransitionOutcome.REJECTED, to, state, version)
        if expected_version is not None and version != expected_version:
            return TransitionResult(TransitionOutcome.STALE, to, state, version)
        return None

    def _expire_identity(self, session: Session, row_id: Any) -> None:
        """Make an ORM instance of the row in this session reload its changed columns."""
        if self.mapper is None or self.id_column not in self.mapper.primary_key:
            if self.mapper is not None:
                session.expire_all()
            return
        key = self.mapper.identity_key_from_primary_key((row_id,))
        instance = session.identity_map.get(key)
        if instance is not None:
            session.expire(instance)


def _mapper_of(target: Any) -> Mapper[Any] | None:
    if isinstance(target, Table):
        return None
    try:
        mapper = inspect(target)
    except NoInspectionAvailable:
        mapper = None
    if not isinstance(mapper, Mapper):
        raise ConfigurationError(
            f"StateMachine target must be a mapped class or a Table, not {target!r}"
        )
    return mapper


def _table_of(target: Any, mapper: Mapper[Any] | None) -> Table:
    if mapper is None:
        assert isinstance(target, Table)
        return target
    table = mapper.local_table
    if not isinstance(table, Table):
        raise ConfigurationError(f"StateMachine: {mapper.class_.__name__} is not mapped to a table")
    return table


def _validated_edges(edges: Mapping[str, Iterable[str]]) -> dict[str, frozenset[str]]:
    if not edges:
        raise ConfigurationError("StateMachine needs at least one edge")
    result: dict[str, frozenset[str]] = {}
    for source, targets in edges.items():
        if isinstance(targets, str):
            raise ConfigurationError(
                f"StateMachine edges: the targets of {source!r} must be a collection of "
                f"states, not the string {targets!r}"
            )
        target_set = frozenset(targets)
        if source in target_set:
            raise ConfigurationError(
                f"StateMachine edges: {source!r} -> {source!r} is a self-loop; a repeat is "
                "already reported as 'already in target state'"
            )
        result[source] = target_set
    return result


def run_transaction(
    database: Engine | sessionmaker[Session],
    work: Callable[[Session], T],
    *,
    attempts: int = 5,
    backoff: float = 0.05,
) -> T:
    """Run ``work(session)`` in a transaction; rerun it on transient database errors.

    Deadlocks, serialization failures and lost connections roll the whole transaction
    back, so the whole unit of work runs again (with jittered exponential backoff, at
    most ``attempts`` times; then the last error is raised). ``work`` must keep all its
    effects in the session (state changes, outbox rows) so that a rerun is safe.
    """
    if attempts < 1:
        raise ConfigurationError("run_transaction attempts must be at least 1")
    sessions = session_factory(database) if isinstance(database, Engine) else database
    for attempt in range(1, attempts + 1):
        try:
            with sessions() as session, session.begin():
                return work(session)
        except Exception as error:
            if attempt == attempts or not is_transient(error):
                raise
            log.info(
                "transient database error; rerunning the transaction",
                extra={"attempt": attempt, "error": type(error).__name__},
            )
            time.sleep(Backoff(backoff, jitter=(0.5, 1.5)).delay(attempt))
    raise AssertionError("unreachable")  # pragma: no cover
