"""The one backoff every wait and retry of mqdedup uses.

A :class:`Backoff` is exponential and capped, with one jitter convention: the capped
delay times a factor drawn uniformly from ``jitter = (low, high)``::

    delay(attempt) = min(maximum, initial * multiplier ** (attempt - 1)) * uniform(low, high)

``(1, 1)`` is no jitter, ``(0.9, 1.1)`` is ±10%, ``(0, 1)`` is tenacity's "full jitter"
(``wait_random_exponential``). A Backoff is also a tenacity ``wait`` (it is called with
the ``RetryCallState`` and uses its attempt number), so the loops retried by tenacity
wait through the same formula.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tenacity import RetryCallState

#: No jitter: every delay is the capped exponential itself.
NO_JITTER = (1.0, 1.0)
#: "Full jitter": anywhere between 0 and the capped exponential (tenacity's
#: ``wait_random_exponential``), so many clients retrying at once spread out.
FULL_JITTER = (0.0, 1.0)


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential, capped, jittered delays (seconds); see the module docstring."""

    initial: float
    maximum: float = math.inf
    multiplier: float = 2.0
    jitter: tuple[float, float] = NO_JITTER

    def delay(self, attempt: int) -> float:
        """Seconds to wait before try ``attempt + 1`` (``attempt`` counts from 1)."""
        exponent = max(0, attempt - 1)
        try:
            base = min(self.maximum, self.initial * self.multiplier**exponent)
        except OverflowError:  # a very long outage: the cap has long been reached
            base = self.maximum
        low, high = self.jitter
        if low == high:
            return float(base * low)
        return float(base * random.uniform(low, high))

    def after(self, previous: float) -> float:
        """The next delay of a loop that keeps its last one: ``previous`` grown, capped
        (no jitter; for waits that start again from ``initial`` when they succeed)."""
        return float(min(self.maximum, previous * self.multiplier))

    def __call__(self, retry_state: RetryCallState) -> float:
        """As a tenacity ``wait``: the delay after the state's attempt number."""
        return self.delay(retry_state.attempt_number)
