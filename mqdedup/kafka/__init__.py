"""The Kafka adapter (kafka-python): consumers (sync and async, on one transport),
transport, offsets, replay, lag, publisher.

This package is the only importer of kafka-python in mqdedup.
"""

# -- the kafka extra (typed43): an ImportError naming it; keep this block first ------------
import warnings as _warnings

from mqdedup.extras import require as _require

with _warnings.catch_warnings():
    # kafka-python 3.0 loads its protocol schemas at import with importlib.resources'
    # read_text / open_text, deprecated on Python 3.11 and 3.12 (not on 3.13): 218
    # DeprecationWarnings in the user's process for one import, none of them actionable.
    _warnings.filterwarnings("ignore", r"(read_text|open_text) is deprecated", DeprecationWarning)
    _require("mqdedup.kafka", "kafka")
# isort: split

from mqdedup.kafka.async_consumer import AsyncKafkaConsumer
from mqdedup.kafka.consumer import KafkaConsumer
from mqdedup.kafka.publisher import KafkaPublisher
from mqdedup.kafka.settings import KafkaSettings

__all__ = ["AsyncKafkaConsumer", "KafkaConsumer", "KafkaPublisher", "KafkaSettings"]
