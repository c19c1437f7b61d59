"""Message ids: the strategies a consumer takes its dedup key with, and id generators.

``from mqdedup import ids`` (or ``import mqdedup.ids``) is the public home of both:

* the message-id *strategies* (:mod:`mqdedup.dedup.ids`): :func:`from_header`,
  :func:`from_amqp_message_id`, :func:`from_coordinates`, :func:`from_content_hash`,
  :func:`from_callable`, :func:`first_of`, and :func:`check_message_id`; for
  producers that send no id (:mod:`mqdedup.dedup.producer_ids`):
  :func:`from_correlation_id` (FastStream) and :func:`from_body_key`;
* the id *generators* (:mod:`mqdedup.id_generators`): :func:`new_message_id` (a
  UUIDv7 for the messages you publish), :class:`Snowflake` (64-bit numeric ids),
  :class:`UUIDv7Generator` and :func:`uuid7_time`, with their errors.

Nothing lives here: the strategies belong to the dedup layer, the generators are a
foundation module with no dependency; this module only names them together.
"""

from mqdedup.dedup.ids import (
    DEFAULT_HEADER,
    MAX_ID_LENGTH,
    InvalidMessageIdError,
    MessageIdStrategy,
    check_message_id,
    first_of,
    from_amqp_message_id,
    from_callable,
    from_content_hash,
    from_coordinates,
    from_header,
)
from mqdedup.dedup.producer_ids import from_body_key, from_correlation_id
from mqdedup.errors import MissingMessageIdError
from mqdedup.id_generators import (
    ClockMovedBackwardsError,
    ClockStalledError,
    ForkedGeneratorError,
    Snowflake,
    UUIDv7Generator,
    new_message_id,
    uuid7_time,
)

__all__ = [
    "DEFAULT_HEADER",
    "MAX_ID_LENGTH",
    "ClockMovedBackwardsError",
    "ClockStalledError",
    "ForkedGeneratorError",
    "InvalidMessageIdError",
    "MessageIdStrategy",
    "MissingMessageIdError",
    "Snowflake",
    "UUIDv7Generator",
    "check_message_id",
    "first_of",
    "from_amqp_message_id",
    "from_body_key",
    "from_callable",
    "from_content_hash",
    "from_coordinates",
    "from_correlation_id",
    "from_header",
    "new_message_id",
    "uuid7_time",
]
