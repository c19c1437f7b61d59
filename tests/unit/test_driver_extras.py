"""A database driver that is not installed is named with the extra that brings it."""

from __future__ import annotations

import sys

import pytest

from mqdedup.db import create_engine
from mqdedup.errors import ConfigurationError


@pytest.mark.parametrize(
    ("module", "url", "extra"),
    [
        ("psycopg", "postgresql://app:S3cret@127.0.0.1:5432/app", "postgresql"),
        ("pymysql", "mysql+pymysql://app:S3cret@127.0.0.1:3306/app", "mysql"),
    ],
)
def test_a_missing_driver_names_its_extra(
    monkeypatch: pytest.MonkeyPatch, module: str, url: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # "not installed"
    with pytest.raises(ConfigurationError) as raised:
        create_engine(url)
    message = str(raised.value)
    assert f"pip install 'mqdedup[{extra}]'" in message
    assert "S3cret" not in message
