"""Group membership defaults: how fast a dead worker's partitions move on.

A consumer-group member that dies without leaving (``kill -9``, an OOM kill, a
process-killing message) keeps its partitions until the broker notices: for
``session_timeout_ms``. Two settings make that seconds, for both Kafka clients:

* **Static membership** (KIP-345, ``group.instance.id``): a child of ``mqdedup worker``
  gets an instance id that is stable per supervisor slot and host
  (``<group>.<host>.<slot>``; the supervisor passes the slot in ``MQDEDUP_WORKER_SLOT``).
  The restarted child rejoins under the same id, and the broker hands it the dead
  member's partitions at once, without a rebalance of the group and without waiting for
  the session to expire. The host is ``MQDEDUP_INSTANCE_HOST`` or the host name (a pod's
  name in Kubernetes). Two supervisors of the same group on one host must set different
  ``MQDEDUP_INSTANCE_HOST`` values (a second member with the same id fences the first);
  ``static_membership = False`` on the class turns it off.
* A **session timeout of 10 s** (kafka-python's own default is 45 s; aiokafka's is 10 s),
  heartbeats every 3 s: a dead member that does not come back (scale-down, a crashed
  host, a static member stopped for good: static members do not leave the group on a
  clean stop) is noticed in about 10 s. The trade-off: a worker frozen for longer than
  that (a stop-the-world pause, a suspended VM) is dropped from the group and its
  partitions move; raise ``session_timeout_ms`` in ``kafka_config`` for such hosts.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping

#: Set by the supervisor in each child: its slot (0, 1, ...) among the target's processes.
SLOT_VARIABLE = "MQDEDUP_WORKER_SLOT"
#: Overrides the host part of the static instance id.
HOST_VARIABLE = "MQDEDUP_INSTANCE_HOST"
#: Consumer settings mqdedup changes for both clients (``kafka_config`` overrides them).
GROUP_DEFAULTS: dict[str, int] = {
    "session_timeout_ms": 10_000,
    "heartbeat_interval_ms": 3_000,
}
_INVALID = re.compile(r"[^A-Za-z0-9._-]+")
#: Kafka's limit on a group.instance.id.
_MAX_LENGTH = 249


def static_instance_id(group_id: str, environ: Mapping[str, str] | None = None) -> str | None:
    """``<group>.<host>.<slot>`` when running as a supervisor's child, else None."""
    env = os.environ if environ is None else environ
    slot = env.get(SLOT_VARIABLE)
    if not slot:
        return None
    host = env.get(HOST_VARIABLE) or socket.gethostname()
    raw = f"{group_id}.{host}.{slot}"
    cleaned = _INVALID.sub("-", raw).strip(".")
    if len(cleaned) > _MAX_LENGTH:  # keep the distinguishing end (host and slot)
        cleaned = cleaned[-_MAX_LENGTH:]
    return cleaned or None
