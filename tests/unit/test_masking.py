"""One masking function for every URL kind: no secret survives in a message or log line."""

from __future__ import annotations

import io
import logging

import pytest
from sqlalchemy.engine import make_url

from mqdedup.db.engine import check_connection, create_engine, parse_url
from mqdedup.dedup.redis_client import mask_redis_url
from mqdedup.errors import DatabaseUnavailableError
from mqdedup.logs import KeyValueFormatter
from mqdedup.masking import mask_text, mask_url
from mqdedup.rabbitmq.topology import connection_parameters, mask_amqp_url

SECRET = "S3cretPW"

# (url, what must remain visible)
URLS = [
    (f"postgresql://app:{SECRET}@db:5432/app", "postgresql://app:***@db:5432/app"),
    (f"postgresql+psycopg://app@db/app?password={SECRET}", "postgresql+psycopg://app@db/app"),
    (f"postgresql://app@db/app?sslmode=require&sslpassword={SECRET}", "sslmode=require"),
    ("postgresql://app:S3c@retPW@db/app", "@db/app"),
    (f"postgresql://app:{SECRET}@h1:5432,h2:5432/app", "@h1:5432,h2:5432/app"),
    (f"mysql+pymysql://app:{SECRET}@db/app?charset=utf8mb4", "charset=utf8mb4"),
    (f"mariadb+pymysql://app@db/app?passwd={SECRET}", "mariadb+pymysql://app@db/app"),
    (f"mysql://app@db/app?pwd={SECRET}&ssl_key=/etc/k.pem", "mysql://app@db/app"),
    (f"sqlite:///tmp/x.db?secret={SECRET}", "sqlite:///tmp/x.db"),
    (f"amqp://guest:{SECRET}@rabbit:5672/%2F", "amqp://guest:***@rabbit:5672/%2F"),
    ("amqps://app:S3c@retPW@rabbit/%2F?heartbeat=30", "heartbeat=30"),
    (f"amqp://rabbit/%2F?token={SECRET}", "amqp://rabbit/%2F"),
    (f"redis://:{SECRET}@redis:6379/0", "redis://:***@redis:6379/0"),
    (f"redis://redis:6379/0?password={SECRET}", "redis://redis:6379/0"),
    (f"rediss://default:{SECRET}@redis/0?api_key={SECRET}", "rediss://default:***@redis/0"),
    (f"unix:///run/redis.sock?password={SECRET}", "unix:///run/redis.sock"),
    (f"SASL_SSL://u:{SECRET}@k1:9092,SASL_SSL://u:{SECRET}@k2:9092", "@k2:9092"),
    (f"u:{SECRET}@k1:9092,k2:9092", "k2:9092"),
    (f"postgresql://db/app?user=a@b&password={SECRET}", "postgresql://"),
    (f"mysql://app:p/w?{SECRET}@db/app", "@db/app"),
]


@pytest.mark.parametrize(("url", "visible"), URLS)
def test_mask_url_hides_every_secret(url: str, visible: str) -> None:
    masked = mask_url(url)
    assert SECRET not in masked
    assert "retPW" not in masked  # the tail after an unescaped @
    assert visible in masked


@pytest.mark.parametrize(("url", "_visible"), URLS)
def test_every_masker_is_the_one_function(url: str, _visible: str) -> None:
    assert mask_url(url) == mask_amqp_url(url) == mask_redis_url(url)


def test_urls_without_secrets_are_unchanged() -> None:
    for url in (
        "postgresql://app@db:5432/app?sslmode=require",
        "sqlite:///mqdedup.db",
        "k1:9092,k2:9092",
        "amqp://rabbit/%2F",
        "redis://redis:6379/0",
    ):
        assert mask_url(url) == url


def test_sqlalchemy_url_objects_are_masked_with_their_query() -> None:
    url = make_url(f"postgresql://app:{SECRET}@db/app?password={SECRET}")
    masked = mask_url(url)
    assert SECRET not in masked and "db/app" in masked


def test_unescaped_at_in_password_reaches_the_driver_whole() -> None:
    parsed = parse_url("postgresql://app:S3c@retPW@db:5432/app")
    assert (parsed.password, parsed.host, parsed.port) == ("S3c@retPW", "db", 5432)


def test_driver_errors_that_echo_a_password_tail_are_scrubbed() -> None:
    url = "postgresql://app:pa@ssWord9@127.0.0.1/app"
    text = mask_text('could not translate host name "ssWord9@127.0.0.1" to address', url)
    assert "ssWord9" not in text
    assert SECRET not in mask_text(f"bad DSN postgresql://x@h/db?password={SECRET}, retry")


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql://app@127.0.0.1:1/app?password={SECRET}",
        "postgresql://app:S3c@retPW@127.0.0.1:1/app",
        "mysql+pymysql://app:S3c@retPW@127.0.0.1:1/app",
    ],
)
def test_connection_errors_never_show_the_password(url: str) -> None:
    with pytest.raises(DatabaseUnavailableError) as caught:
        check_connection(create_engine(url))
    assert SECRET not in str(caught.value) and "retPW" not in str(caught.value)


def test_log_lines_mask_urls() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(KeyValueFormatter("%(message)s"))
    logger = logging.getLogger("tests.masking")
    logger.addHandler(handler)
    try:
        logger.warning(
            "cannot use redis://redis/0?password=%s", SECRET, extra={"url": f"amqp://a:{SECRET}@h/"}
        )
    finally:
        logger.removeHandler(handler)
    assert SECRET not in stream.getvalue()
    assert "redis://redis/0?password=***" in stream.getvalue()


def test_amqp_user_without_password_means_an_empty_password() -> None:
    parameters = connection_parameters("amqp://app@rabbit:5672/%2F", "test")
    assert parameters.credentials.username == "app"
    assert parameters.credentials.password == ""
    assert parameters.host == "rabbit"
