"""The test kit: a pytest plugin and harnesses that run consumers the way production does.

The fixtures (``mqdedup_harness``, ``mqdedup_kafka_harness``, ...) come from
:mod:`mqdedup.testing.plugin`, registered as a pytest plugin on install.
"""

from mqdedup.testing.effects import (
    DownstreamMessage,
    EffectivelyOnceError,
    assert_effectively_once,
    downstream_effects,
)
from mqdedup.testing.plugin import ConsumerHarness

__all__ = [
    "ConsumerHarness",
    "DownstreamMessage",
    "EffectivelyOnceError",
    "assert_effectively_once",
    "downstream_effects",
]
