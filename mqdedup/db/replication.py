"""Does a committed claim survive a failover? What the primary says of its standbys.

A claim that committed is a message that never runs again, and its offset or ack goes
to the broker right after the commit. With *asynchronous* streaming replication the
primary reports a commit before any standby has it: when the primary dies and a standby
is promoted, the last transactions are gone while their messages are settled, lost for
good, silently. :func:`replication_state` reads what decides it (``pg_stat_replication``'s
``sync_state``, ``synchronous_standby_names``, ``synchronous_commit``) and
:meth:`ReplicationState.warning` says, in one line, when claims are not durable across a
failover and which setting makes them so. ``mqdedup db check`` and ``mqdedup worker``
print it.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine, text

#: ``synchronous_commit`` values that do not wait for a synchronous standby.
_LOCAL_COMMITS = ("off", "local")


@dataclass(frozen=True)
class ReplicationState:
    """The primary's view of its streaming standbys and its commit setting."""

    #: Standbys streaming from this server (``pg_stat_replication`` rows).
    standbys: int
    #: Of those, the ones a commit waits for (``sync_state`` ``sync`` or ``quorum``).
    synchronous: int
    #: Standbys whose ``sync_state`` this role may not read (needs ``pg_monitor``).
    hidden: int
    synchronous_standby_names: str
    synchronous_commit: str

    def warning(self) -> str | None:
        """One line when a failover could lose committed claims; None when it cannot."""
        if self.standbys in (0, self.hidden):  # none, or none this role may read
            return None
        if self.synchronous == 0:
            return (
                f"the database replicates asynchronously to {self.standbys} standby(s): a "
                "failover can lose transactions the primary reported committed, claims "
                "included, whose messages were already settled; make claims durable "
                "across failover with synchronous_standby_names naming the standbys and "
                "synchronous_commit = on (or remote_apply)"
            )
        if self.synchronous_commit in _LOCAL_COMMITS:
            return (
                f"synchronous_commit = {self.synchronous_commit} does not wait for the "
                "synchronous standby: a failover can lose committed claims; set "
                "synchronous_commit = on (or remote_apply)"
            )
        return None


def replication_state(engine: Engine) -> ReplicationState | None:
    """What the PostgreSQL behind ``engine`` says of its standbys (None elsewhere)."""
    if engine.dialect.name != "postgresql":
        return None
    with engine.connect() as connection:
        row = connection.execute(
            text(
                "SELECT count(*), "
                "count(*) FILTER (WHERE sync_state IN ('sync', 'quorum')), "
                "count(*) FILTER (WHERE sync_state IS NULL), "
                "current_setting('synchronous_standby_names'), "
                "current_setting('synchronous_commit') "
                "FROM pg_stat_replication"
            )
        ).one()
    return ReplicationState(
        standbys=int(row[0]),
        synchronous=int(row[1]),
        hidden=int(row[2]),
        synchronous_standby_names=str(row[3]),
        synchronous_commit=str(row[4]),
    )


def replication_warning(engine: Engine) -> str | None:
    """:meth:`ReplicationState.warning` of ``engine``'s database (None: nothing to say)."""
    state = replication_state(engine)
    return None if state is None else state.warning()
