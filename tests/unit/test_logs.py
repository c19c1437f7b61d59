"""Log lines: JSON with the structured fields, secrets masked, client libraries quiet."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from mqdedup.logs import configure


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name in ("kafka", "pika"):
        logging.getLogger(name).setLevel(logging.NOTSET)


def test_json_lines_carry_the_structured_context_and_mask_secrets(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure("INFO", "json")
    logging.getLogger("mqdedup.test").warning(
        "dead-lettered",
        extra={
            "consumer": "orders",
            "message_id": "m-1",
            "coordinates": "orders/2/41",
            "url": "postgresql://app:S3cret@db/app",
        },
    )
    line = capsys.readouterr().err.strip()
    entry = json.loads(line)
    assert entry["level"] == "WARNING" and entry["message"] == "dead-lettered"
    assert (entry["consumer"], entry["message_id"], entry["coordinates"]) == (
        "orders",
        "m-1",
        "orders/2/41",
    )
    assert "S3cret" not in line


def test_client_libraries_are_quiet_unless_debugging(capsys: pytest.CaptureFixture[str]) -> None:
    configure("WARNING")
    logging.getLogger("kafka.conn").error("connect attempt to 127.0.0.1:1 failed")
    logging.getLogger("pika.adapters").warning("Socket closed")
    logging.getLogger("mqdedup.cli.main").warning("cannot reach Kafka")
    err = capsys.readouterr().err
    assert "cannot reach Kafka" in err and "connect attempt" not in err and "Socket" not in err
    configure("DEBUG")
    logging.getLogger("kafka.conn").error("connect attempt to 127.0.0.1:1 failed")
    assert "connect attempt" in capsys.readouterr().err


def test_unknown_level_and_format_are_refused() -> None:
    with pytest.raises(ValueError, match=r"BOGUS.*DEBUG, INFO"):
        configure("BOGUS")
    with pytest.raises(ValueError, match="xml"):
        configure("INFO", "xml")
