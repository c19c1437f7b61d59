"""PostgreSQL behind a pooler and with replicas, without a database (issue 30): the
``pooler`` URL parameter, URLs with several hosts (and their masking), the relay's
coordination settings, and when ``db check`` warns about replication."""

from __future__ import annotations

import pytest

from mqdedup.db import create_engine
from mqdedup.db.engine import parse_url
from mqdedup.db.pooling import declares_transaction_pooler, pooler_of, split_hosts
from mqdedup.db.replication import ReplicationState
from mqdedup.errors import ConfigurationError
from mqdedup.masking import mask_text, mask_url
from mqdedup.outbox.coordination import check_coordination
from mqdedup.outbox.relay import RelayConfig

MULTI = "postgresql://app:s3cret@db-a:5432,db-b:5433/shop?target_session_attrs=read-write"


def test_libpq_hosts_become_sqlalchemy_host_parameters() -> None:
    parsed = parse_url(MULTI)
    assert parsed.query["host"] == ("db-a:5432", "db-b:5433")
    assert parsed.query["target_session_attrs"] == "read-write"
    assert parsed.database == "shop" and parsed.password == "s3cret"
    assert split_hosts("postgresql://u@h1,h2/db") == "postgresql://u@/db?host=h1&host=h2"
    assert split_hosts("mysql://u@h1,h2/db") == "mysql://u@h1,h2/db"  # PostgreSQL only
    assert split_hosts("postgresql://u:p,w@h/db") == "postgresql://u:p,w@h/db"


def test_a_multi_host_url_is_masked_in_messages_and_logs() -> None:
    for shown in (mask_url(parse_url(MULTI)), mask_url(MULTI), mask_text(f"failed: {MULTI}")):
        assert "s3cret" not in shown and "app:***@" in shown
        assert "db-b" in shown


def test_the_pooler_parameter_is_checked_and_never_reaches_the_driver() -> None:
    assert pooler_of(parse_url("postgresql://u@h/db")) == "auto"
    assert pooler_of(parse_url("postgresql://u@h/db?pooler=transaction")) == "transaction"
    with pytest.raises(ConfigurationError, match="pooler='statement' is not one of"):
        parse_url("postgresql://u@h/db?pooler=statement")
    engine = create_engine("postgresql://u@h/db?pooler=transaction-prepared")
    assert declares_transaction_pooler(engine)
    assert not declares_transaction_pooler(create_engine("postgresql://u@h/db?pooler=session"))
    _, cparams = engine.dialect.create_connect_args(engine.url)
    assert "pooler" in cparams  # SQLAlchemy passes query parameters on ...
    engine.dispose()  # ... and the engine's do_connect hook drops it (tested live)


def test_relay_coordination_is_checked_before_anything_connects() -> None:
    pooled = create_engine("postgresql://u:pw@h:6432/db?pooler=transaction")
    direct = create_engine("postgresql://u:pw@h:5432/db")
    with pytest.raises(ConfigurationError, match="transaction pooler") as refused:
        check_coordination(pooled, None, "session", table_name="t")
    assert "pw" not in str(refused.value).replace("pooler", "")
    assert check_coordination(pooled, direct, "session", table_name="t") is None
    assert isinstance(check_coordination(pooled, None, "transaction", table_name="t"), int)
    with pytest.raises(ConfigurationError, match="needs none"):
        check_coordination(pooled, direct, "transaction", table_name="t")
    with pytest.raises(ConfigurationError, match="for PostgreSQL"):
        check_coordination(create_engine("sqlite://"), None, "transaction", table_name="t")
    with pytest.raises(ConfigurationError, match="coordination must be one of"):
        RelayConfig(coordination="turns")


def state(standbys: int, synchronous: int, commit: str = "on", hidden: int = 0) -> ReplicationState:
    names = "replica" if synchronous else ""
    return ReplicationState(standbys, synchronous, hidden, names, commit)


def test_the_replication_warning_names_the_setting_that_makes_claims_durable() -> None:
    assert state(0, 0).warning() is None  # no standby: nothing to fail over to
    assert state(1, 1).warning() is None
    assert state(2, 2, hidden=2).warning() is None  # cannot tell: no false alarm
    warning = state(2, 0).warning()
    assert warning is not None
    assert "asynchronously to 2 standby(s)" in warning
    assert "synchronous_standby_names" in warning and "synchronous_commit = on" in warning
    local = state(1, 1, commit="local").warning()
    assert local is not None and "synchronous_commit = local" in local
