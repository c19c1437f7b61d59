"""Group membership defaults: how fast a dead worker's partitions move on.

A consumer-group member that dies without leaving (``kill -9``, an OOM kill, a
process-killing message) keeps its partitions until the broker notices: for
``session_timeout_ms``. Two settings make that seconds, for both Kafka clients:

* **Static membership** (KIP-345, ``group.instance.id``): a child of ``mqdedup worker``
  gets an instance id that is stable for as long as its supervisor runs:
  ``<group>.<host>.<supervisor pid>.<slot>`` (the child reads its slot from
  ``MQDEDUP_WORKER_SLOT`` and its supervisor's pid from ``MQDEDUP_WORKER_SUPERVISOR``).
  The restarted child rejoins under the same id, and the broker hands it the dead
  member's partitions at once, without a rebalance of the group and without waiting for
  the session to expire. The supervisor's pid is part of the id; a second supervisor of
  the same consumer on one host is refused unless it has its own
  ``MQDEDUP_INSTANCE_HOST`` (:mod:`mqdedup.cli.lineage`). A deployment that
  gives each supervisor a stable name of its own (a StatefulSet pod, a systemd unit
  instance) sets ``MQDEDUP_INSTANCE_HOST`` to it: the id is then
  ``<group>.<MQDEDUP_INSTANCE_HOST>.<slot>``, the same across supervisor restarts, so a
  restarted supervisor also takes its partitions back at once; two supervisors must then
  never share the value. ``static_membership = False`` on the class turns it off.
* **Fenced.** When a second member joins the group under the same instance id (two
  supervisors sharing ``MQDEDUP_INSTANCE_HOST``, on two hosts: on one host the second
  supervisor is refused, :mod:`mqdedup.cli.lineage`), the broker fences the first one:
  its offset commits fail with ``FencedInstanceIdError``. The fenced member stops
  consuming (it never joins again, which would fence the other back), reports
  ``consumer_attached = 0`` and its reason (``fenced``) in its metrics, so ``/healthz``
  answers 503 naming the cause, and logs one ERROR line (:func:`fenced_reason`). It keeps
  running until it is stopped: the newer member consumes, the operator fixes the names.
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
#: Set by the supervisor in each child: the supervisor's pid (keeps supervisors apart).
SUPERVISOR_VARIABLE = "MQDEDUP_WORKER_SUPERVISOR"
#: A stable name of this supervisor, unique among the group's supervisors: replaces the
#: host name and the supervisor's pid in the static instance id.
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
    """The static member id when running as a supervisor's child, else None:
    ``<group>.<MQDEDUP_INSTANCE_HOST>.<slot>`` when that is set, else
    ``<group>.<host name>.<supervisor pid>.<slot>``."""
    env = os.environ if environ is None else environ
    slot = env.get(SLOT_VARIABLE)
    if not slot:
        return None
    named = env.get(HOST_VARIABLE)
    if named:
        raw = f"{group_id}.{named}.{slot}"
    else:
        parts = [group_id, socket.gethostname(), env.get(SUPERVISOR_VARIABLE), slot]
        raw = ".".join(part for part in parts if part)
    cleaned = _INVALID.sub("-", raw).strip(".")
    if len(cleaned) > _MAX_LENGTH:  # keep the distinguishing end (host and slot)
        cleaned = cleaned[-_MAX_LENGTH:]
    return cleaned or None


def fenced_reason(
    group_id: str, instance_id: str | None, environ: Mapping[str, str] | None = None
) -> str:
    """What a fenced member says (log line, ``/healthz``): who fenced it, and the fix."""
    env = os.environ if environ is None else environ
    named = env.get(HOST_VARIABLE)
    cause = (
        f"two supervisors share {HOST_VARIABLE}={named}"
        if named
        else "two consumers use the same group_instance_id"
    )
    return (
        f"fenced: another member of group {group_id!r} joined with this member's static id "
        f"{instance_id!r} ({cause}); this one stopped consuming: stop it, or give each "
        f"supervisor its own {HOST_VARIABLE}"
    )
