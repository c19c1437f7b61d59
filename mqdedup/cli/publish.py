"""``mqdedup publish``: send one message the way a mqdedup consumer wants it.

For operators (re-sending a message by hand, with its original id so the consumers
skip it if it was processed) and for tests. The message gets a ``message-id`` (``--id``
or a new UUIDv7), a content type and the trace context, through
:func:`mqdedup.kafka.producing.send_message` or
:func:`mqdedup.rabbitmq.producing.publish_message`; the command waits for the broker's
acknowledgement and prints the message id.

    mqdedup publish --topic orders --body '{"order": 1}' --kafka-bootstrap localhost:9092
    mqdedup publish --queue orders --file order.json --id order-1-placed
    echo '{"order": 2}' | mqdedup publish --exchange shop --routing-key orders.placed
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mqdedup.cli.config import env_help, resolve_settings
from mqdedup.errors import BrokerUnavailableError, ConfigurationError

__all__ = ["add_publish_parser", "cmd_publish"]


def add_publish_parser(commands: Any) -> None:
    """The ``publish`` sub-command (``commands``: the parser's sub-parsers)."""
    publish = commands.add_parser(
        "publish",
        help="send one message with a message id (Kafka topic, RabbitMQ exchange or queue)",
        description="Send one message stamped with a message-id (--id, else a new UUIDv7), "
        "its content type and the trace context; print its message id.",
    )
    target = publish.add_mutually_exclusive_group(required=True)
    target.add_argument("--topic", help="a Kafka topic")
    target.add_argument("--exchange", help="a RabbitMQ exchange (with --routing-key)")
    target.add_argument("--queue", help="a RabbitMQ queue (the default exchange)")
    publish.add_argument("--routing-key", default="", help="RabbitMQ routing key")
    source = publish.add_mutually_exclusive_group()
    source.add_argument("--body", help="the body, as text (default: read stdin)")
    source.add_argument("--file", type=Path, help="read the body from a file ('-': stdin)")
    publish.add_argument("--id", dest="message_id", help="the message id (default: a UUIDv7)")
    publish.add_argument("--key", help="the Kafka record key")
    publish.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a header to add (repeatable)",
    )
    publish.add_argument(
        "--content-type",
        default=None,
        help="the content type (default: application/json for a JSON body, else text/plain)",
    )
    publish.add_argument(
        "--kafka-bootstrap",
        metavar="HOST:PORT[,...]",
        default=None,
        help="Kafka bootstrap servers" + env_help("kafka_bootstrap"),
    )
    publish.add_argument(
        "--rabbitmq-url",
        metavar="URL",
        default=None,
        help="RabbitMQ URL" + env_help("rabbitmq_url"),
    )
    publish.add_argument("--timeout", type=float, default=10.0, help="seconds to wait (10)")
    publish.add_argument("--json", action="store_true", help="print JSON")
    publish.set_defaults(run=cmd_publish)


def cmd_publish(args: argparse.Namespace) -> int:
    """Run ``mqdedup publish``."""
    body = _read_body(args)
    headers = _parse_headers(args.header)
    content_type = args.content_type or _guess_content_type(body)
    if args.topic is not None:
        settings = resolve_settings(args, "kafka_bootstrap")
        bootstrap = settings["kafka_bootstrap"]
        if not bootstrap:
            raise ConfigurationError(
                "--topic needs Kafka: pass --kafka-bootstrap or set MQDEDUP_KAFKA_BOOTSTRAP"
            )
        message_id = _send_kafka(args, str(bootstrap), body, headers, content_type)
        destination = f"topic {args.topic}"
    else:
        settings = resolve_settings(args, "rabbitmq_url")
        url = settings["rabbitmq_url"]
        if not url:
            raise ConfigurationError(
                "publishing to RabbitMQ needs --rabbitmq-url or MQDEDUP_RABBITMQ_URL"
            )
        if args.exchange is not None and not args.routing_key:
            raise ConfigurationError("--exchange needs --routing-key")
        message_id = _publish_rabbitmq(args, str(url).split(",")[0], body, headers, content_type)
        destination = (
            f"queue {args.queue}"
            if args.queue is not None
            else f"exchange {args.exchange} ({args.routing_key})"
        )
    if args.json:
        print(json.dumps({"message_id": message_id, "destination": destination}))
    else:
        print(message_id)
    return 0


def _read_body(args: argparse.Namespace) -> bytes:
    if args.body is not None:
        return str(args.body).encode("utf-8")
    if args.file is not None and str(args.file) != "-":
        try:
            return Path(args.file).read_bytes()
        except OSError as error:
            raise ConfigurationError(f"cannot read --file {args.file}: {error.strerror}") from None
    if args.file is None and sys.stdin.isatty():
        raise ConfigurationError("no body: pass --body, --file or pipe it on stdin")
    return sys.stdin.buffer.read()


def _parse_headers(items: list[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for item in items:
        name, separator, value = item.partition("=")
        if not separator or not name.strip():
            raise ConfigurationError(f"--header {item!r}: expected NAME=VALUE")
        headers[name.strip()] = value
    return headers


def _guess_content_type(body: bytes) -> str:
    try:
        json.loads(body)
    except (UnicodeDecodeError, ValueError):
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            return "application/octet-stream"
        return "text/plain; charset=utf-8"
    return "application/json"


def _send_kafka(
    args: argparse.Namespace,
    bootstrap: str,
    body: bytes,
    headers: dict[str, str],
    content_type: str,
) -> str:
    from mqdedup.kafka.producing import open_producer, send_message

    producer = open_producer(bootstrap, timeout=args.timeout)
    try:
        return send_message(
            producer,
            args.topic,
            body,
            key=args.key,
            message_id=args.message_id,
            headers=headers,
            content_type=content_type,
            timeout=args.timeout,
        )
    except ValueError as error:
        raise ConfigurationError(str(error)) from None
    except Exception as error:  # kafka-python's errors: the broker did not take it
        raise BrokerUnavailableError(
            f"Kafka did not acknowledge the message: {type(error).__name__}: {error}"
        ) from None
    finally:
        producer.close(timeout=args.timeout)


def _publish_rabbitmq(
    args: argparse.Namespace,
    url: str,
    body: bytes,
    headers: dict[str, str],
    content_type: str,
) -> str:
    from mqdedup.rabbitmq.producing import open_channel, publish_message

    channel = open_channel(url, timeout=args.timeout)
    try:
        return publish_message(
            channel,
            body,
            exchange=args.exchange or "",
            routing_key=args.queue if args.queue is not None else args.routing_key,
            message_id=args.message_id,
            headers=headers,
            content_type=content_type,
        )
    except ValueError as error:
        raise ConfigurationError(str(error)) from None
    except Exception as error:  # pika's: unroutable (no queue bound), nacked, closed
        if type(error).__name__ in ("UnroutableError", "NackError"):
            raise ConfigurationError(
                f"RabbitMQ refused the message ({type(error).__name__}): no queue takes "
                f"routing key {args.queue or args.routing_key!r} on the exchange "
                f"{args.exchange or '(default)'!r}"
            ) from None
        raise BrokerUnavailableError(
            f"RabbitMQ did not take the message: {type(error).__name__}: {error}"
        ) from None
    finally:
        channel.connection.close()
