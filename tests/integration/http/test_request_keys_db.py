"""The request-key core on the real databases: in flight is answered at once, repeats replay."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from sqlalchemy.orm import Session

from mqdedup.dedup.request_keys import KeyedRequest, KeyState, RequestKeys, StoredResponse
from tests.services import TestDatabase, prefixed_database

pytestmark = pytest.mark.integration


@pytest.fixture(params=["postgresql", "mariadb"])
def database(request: pytest.FixtureRequest) -> Iterator[TestDatabase]:
    if request.param == "postgresql":
        url, service = request.getfixturevalue("pg_url"), "PostgreSQL"
    else:
        url, service = request.getfixturevalue("mariadb_url"), "MariaDB"
    with prefixed_database(url, service) as db:
        yield db


def test_in_flight_is_409_at_once_and_concurrent_repeats_replay(database: TestDatabase) -> None:
    keys = RequestKeys(database.prefix)
    request = KeyedRequest("http:alice", "key-1", "fingerprint-1")
    first = Session(database.engine)
    repeats: list[Session] = []
    try:
        first.begin()
        assert keys.claim(first, request).state is KeyState.NEW
        # A repeat while the first is uncommitted: answered without waiting for it.
        in_flight = Session(database.engine)
        repeats.append(in_flight)
        in_flight.begin()
        started = time.monotonic()
        claim = keys.claim(in_flight, request)
        assert claim.state is KeyState.IN_FLIGHT
        assert claim.answer is not None and claim.answer.status == 409
        assert time.monotonic() - started < 1.0
        in_flight.rollback()

        assert keys.store(first, request, StoredResponse(201, (), b'{"id": 1}'))
        first.commit()

        # Two repeats in flight at the same time both get the stored response.
        for _ in range(2):
            repeat = Session(database.engine)
            repeats.append(repeat)
            repeat.begin()
            claim = keys.claim(repeat, request)
            assert claim.state is KeyState.REPLAY
            assert claim.answer is not None and claim.answer.body == b'{"id": 1}'
        other = Session(database.engine)
        repeats.append(other)
        other.begin()
        mismatch = keys.claim(other, KeyedRequest("http:alice", "key-1", "fingerprint-2"))
        assert mismatch.state is KeyState.MISMATCH
    finally:
        for session in (first, *repeats):
            session.close()
