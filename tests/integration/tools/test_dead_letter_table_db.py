"""The dead-letter table on PostgreSQL and MariaDB: kept once per message id, bytes exact."""

from __future__ import annotations

from sqlalchemy.orm import Session

from mqdedup.dedup.dead_letters import DeadLetterCause, DeadLetterTable
from mqdedup.message import Message
from tests.integration.tools.conftest import Database

CAUSE = DeadLetterCause(
    reason="handler failed after 3 attempts: ValueError: bad \x00 input \ud800",
    attempts=3,
    refusal="MessageSizeTooLargeError: the record is too large",
    error_class="builtins.ValueError",
    error_message="bad \x00 input",
)


def test_a_message_is_kept_once_with_its_original_bytes(database: Database) -> None:
    table = DeadLetterTable(database.prefix)
    message = Message(
        body=bytes(range(256)) * 40,
        id="order-1",
        key=b"\x00key",
        headers={"bin": b"\xff\x00", "text": "nul \x00 here", "none": None, "ok": "caf\u00e9"},
        properties={"message_id": "order-1", "timestamp": 1700000000, "exchange": ""},
        source="orders",
        partition=2,
        offset=41,
    )
    for _ in range(2):  # a redelivery after a lost settle parks nothing twice
        with Session(database.engine) as session, session.begin():
            table.park(session, "orders-consumer", message, CAUSE)
    without_id = Message(body=b"{oops", source="orders", partition=0, offset=7)
    for _ in range(2):  # no id: kept as often as refused
        with Session(database.engine) as session, session.begin():
            table.park(session, "orders-consumer", without_id, CAUSE)

    with Session(database.engine) as session:
        rows = table.list(session, "orders-consumer")
        counts = table.counts(session)
    assert counts == {"orders-consumer": 3}
    kept = rows[0]
    assert kept.message.body == message.body
    assert kept.message.key == message.key
    assert dict(kept.message.headers) == dict(message.headers)
    assert kept.message.properties["timestamp"] == 1700000000
    assert kept.message.coordinates == "orders/2/41"
    assert kept.attempts == 3
    assert "\x00" not in kept.reason and "bad \\x00 input" in kept.reason
    assert kept.refusal == CAUSE.refusal
    assert [row.message.id for row in rows[1:]] == [None, None]
