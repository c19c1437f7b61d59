"""A framework's wrapper of a driver error (Django's ``OperationalError`` raised from an
ORM call in a handler) is classified by the driver error it carries as its cause."""

from __future__ import annotations

import psycopg
import pytest

from mqdedup.db.dialects import is_transient


class FrameworkOperationalError(Exception):
    """Stands in for ``django.db.utils.OperationalError`` (``raise ... from driver_error``)."""


def wrapped(cause: BaseException) -> FrameworkOperationalError:
    try:
        raise FrameworkOperationalError(str(cause)) from cause
    except FrameworkOperationalError as error:
        return error


@pytest.mark.parametrize(
    ("cause", "transient"),
    [
        (psycopg.OperationalError("server closed the connection unexpectedly"), True),
        (psycopg.InterfaceError("the connection is closed"), True),
        (psycopg.errors.UniqueViolation("duplicate key"), False),
        (ValueError("not a database error"), False),
    ],
)
def test_a_wrapped_driver_error_counts_as_its_cause(cause: Exception, transient: bool) -> None:
    assert is_transient(wrapped(cause)) is transient


def test_an_error_merely_raised_while_handling_one_is_not_its_cause() -> None:
    try:
        try:
            raise psycopg.OperationalError("lost")
        except psycopg.OperationalError:
            raise RuntimeError("the handler's own bug") from None
    except RuntimeError as error:
        assert is_transient(error) is False
