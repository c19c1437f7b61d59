"""What a test asserts: each message's effects happened once, here and downstream.

Used by the harnesses (:mod:`mqdedup.testing.plugin`, :mod:`mqdedup.testing.brokers`)
and by users' own tests (all names are re-exported from :mod:`mqdedup.testing`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from mqdedup.message import Message

__all__ = [
    "DownstreamMessage",
    "EffectivelyOnceError",
    "assert_effectively_once",
    "downstream_effects",
]


class EffectivelyOnceError(AssertionError):
    """Some message's effects happened more than once, or never."""


def assert_effectively_once(
    effects: Mapping[str, int], expected_ids: Iterable[str], *, allow_missing: bool = False
) -> None:
    """Assert that each expected message id has exactly one effect.

    ``effects`` maps a message id to how many times its effect is found (e.g. rows per
    message id in your business table). Extra ids, doubles and (unless
    ``allow_missing``) missing ids fail with a precise message.
    """
    expected = set(expected_ids)
    doubled = {key: count for key, count in effects.items() if count > 1}
    unexpected = sorted(set(effects) - expected)
    missing = sorted(expected - {key for key, count in effects.items() if count > 0})
    problems = []
    if doubled:
        sample = dict(sorted(doubled.items())[:5])
        problems.append(f"{len(doubled)} message id(s) applied more than once, e.g. {sample}")
    if missing and not allow_missing:
        problems.append(f"{len(missing)} message id(s) never applied, e.g. {missing[:5]}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected id(s), e.g. {unexpected[:5]}")
    if problems:
        raise EffectivelyOnceError("; ".join(problems))


@dataclass(frozen=True)
class DownstreamMessage:
    """A message your consumer sent on, as the next consumer would see it.

    ``message_id``: its ``message-id`` header / AMQP ``message_id`` (the next consumer's
    dedup key); ``cause``: its ``causation-id`` header, the incoming message it results
    from (the outbox sets it; set it yourself when you publish otherwise).
    """

    message_id: str | None
    cause: str | None
    body: bytes

    @classmethod
    def from_headers(
        cls, body: bytes, headers: Mapping[str, bytes | str | None]
    ) -> DownstreamMessage:
        """Build one from a body and headers (``message-id``, ``causation-id``)."""

        def text(name: str) -> str | None:
            value = headers.get(name)
            return value.decode("utf-8", "replace") if isinstance(value, bytes) else value

        return cls(message_id=text("message-id"), cause=text("causation-id"), body=body)

    @classmethod
    def from_message(cls, message: Message) -> DownstreamMessage:
        """Build one from a :class:`~mqdedup.message.Message` (in-memory broker)."""
        return cls.from_headers(message.body, message.headers)


def downstream_effects(
    messages: Iterable[DownstreamMessage],
    cause: Callable[[DownstreamMessage], str | None] | None = None,
) -> dict[str, int]:
    """Effects downstream per incoming message id, for :func:`assert_effectively_once`.

    Brokers deliver at least once, so the next consumer must deduplicate anyway: a
    message sent twice *with the same message id* is one effect. The effect count of an
    incoming message is therefore the number of **distinct** message ids sent for it;
    a message without an id cannot be deduplicated and counts on its own. ``cause``
    picks the incoming message id (default: the ``causation-id`` header).
    """
    pick = cause or (lambda message: message.cause)
    ids: dict[str, set[str]] = {}
    anonymous: dict[str, int] = {}
    for message in messages:
        origin = pick(message)
        if origin is None:
            origin = "<no causation id>"
        if message.message_id is None:
            anonymous[origin] = anonymous.get(origin, 0) + 1
        else:
            ids.setdefault(origin, set()).add(message.message_id)
    return {
        origin: len(ids.get(origin, ())) + anonymous.get(origin, 0)
        for origin in set(ids) | set(anonymous)
    }
