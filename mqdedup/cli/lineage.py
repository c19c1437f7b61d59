"""What ties the children of ``mqdedup worker`` / ``mqdedup relay`` to their supervisor, so
that none outlives it unnoticed (POSIX):

* **The lifeline**: a pipe whose only write end the supervisor holds (the supervisor
  never writes to it). Each child reads the other end in a thread; end of file means the
  supervisor is gone (``kill -9``, a crash, an OOM kill): the kernel closes the write
  end of a dead process, whenever it died, so a child that starts after its supervisor
  died sees it too. The child then stops cleanly, as on SIGTERM (the batch in flight
  committed and settled, its locks released), within the shutdown timeout.
* **The slot lock**: an ``flock`` on one file per slot (the command, its target — the
  consumer name, or the relay's outbox table —, the database and table prefix, and
  ``MQDEDUP_INSTANCE_HOST``) in the runtime directory. The supervisor takes it and every
  child holds the same open file, so it stays held while any of them lives, also children
  their supervisor left behind. A second supervisor for the same slots refuses to start
  (one line, exit code 1) until they are all gone. Several supervisors of one target on
  one host each set their own ``MQDEDUP_INSTANCE_HOST`` (it also names their static
  Kafka group membership, :mod:`mqdedup.kafka.membership`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import reduction
from pathlib import Path
from typing import Any

from mqdedup.cli.exitcodes import RefusedError

log = logging.getLogger(__name__)

#: Where the slot locks live (default: ``$XDG_RUNTIME_DIR/mqdedup``, else
#: ``<temp dir>/mqdedup-<uid>``). Containers with their own ``/tmp`` never share it.
RUNTIME_DIR_VARIABLE = "MQDEDUP_RUNTIME_DIR"
#: The supervisor's stable name (as in :mod:`mqdedup.kafka.membership`).
INSTANCE_HOST_VARIABLE = "MQDEDUP_INSTANCE_HOST"


def runtime_dir() -> Path:
    """The directory of the slot locks (created on first use, private to the user)."""
    configured = os.environ.get(RUNTIME_DIR_VARIABLE)
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "mqdedup"
    return Path(tempfile.gettempdir()) / f"mqdedup-{os.getuid()}"


@dataclass(frozen=True)
class Slot:
    """The processes one supervisor runs for one target."""

    command: str
    target: str
    database_url: str
    table_prefix: str

    def path(self, directory: Path) -> Path:
        """The lock file: a hash, so that no URL (or password) appears in a file name."""
        instance = os.environ.get(INSTANCE_HOST_VARIABLE, "")
        parts = (self.command, self.target, self.database_url, self.table_prefix, instance)
        key = "\0".join(parts)
        return directory / f"{self.command}-{hashlib.sha256(key.encode()).hexdigest()[:20]}.lock"


def lock_slots(slots: Sequence[Slot]) -> list[int]:
    """Take the lock of every slot (their open file descriptors) or refuse, in one line.

    A runtime directory that cannot be written (a read-only file system) is a WARNING,
    not a refusal: the supervisor then runs without the lock (its children still never
    outlive it).
    """
    directory = runtime_dir()
    held: list[int] = []
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        for slot in slots:
            held.append(_lock(slot, slot.path(directory)))
    except OSError as exc:
        for fd in held:
            os.close(fd)
        log.warning(
            "cannot lock the supervisor's slots; a second supervisor would not be refused "
            f"(set {RUNTIME_DIR_VARIABLE} to a writable directory)",
            extra={"directory": str(directory), "error": exc.strerror or str(exc)},
        )
        return []
    except BaseException:
        for fd in held:
            os.close(fd)
        raise
    return held


def _lock(slot: Slot, path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        instance = os.environ.get(INSTANCE_HOST_VARIABLE)
        named = f" as {INSTANCE_HOST_VARIABLE}={instance}" if instance else ""
        raise RefusedError(
            f"another `mqdedup {slot.command}` runs {slot.target}{named} on this host "
            f"(supervisor pid {holder}, or the children it left): stop it first, or give "
            f"each supervisor its own {INSTANCE_HOST_VARIABLE} (lock {path})"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class InheritedFd:
    """A file descriptor a spawned child receives, open on the same file (same lock)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Callable[[Any], int], tuple[Any]]:
        # Pickled while spawning: multiprocessing passes the descriptor to the child.
        return _detach, (reduction.DupFd(self.fd),)


def _detach(duplicate: Any) -> int:
    return int(duplicate.detach())


@dataclass(frozen=True)
class Bond:
    """What a child receives: the lifeline's read end and the slot locks (kept open)."""

    lifeline: InheritedFd | int
    locks: tuple[InheritedFd | int, ...] = ()


class Lifeline:
    """The supervisor's side: a pipe it alone holds the write end of, for its lifetime."""

    def __init__(self, locks: Sequence[int] = ()) -> None:
        self._read, write = os.pipe()
        self._locks = tuple(locks)
        self._fds = (self._read, write, *self._locks)  # what close() releases

    def bond(self) -> Bond:
        """What to pass to a child process (spawned) as an argument."""
        return Bond(InheritedFd(self._read), tuple(InheritedFd(fd) for fd in self._locks))

    def close(self) -> None:
        """Release the pipe and the slot locks (the children are gone); once."""
        fds, self._fds = self._fds, ()
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def watch_supervisor(bond: Bond, on_death: Callable[[], None]) -> threading.Thread:
    """In a child: call ``on_death`` (from a daemon thread) once the supervisor is gone."""
    read_fd = bond.lifeline if isinstance(bond.lifeline, int) else bond.lifeline.fd

    def _watch() -> None:
        while True:
            try:
                if not os.read(read_fd, 1):
                    break
            except OSError:
                break
        on_death()

    thread = threading.Thread(target=_watch, daemon=True, name="supervisor-watch")
    thread.start()
    return thread
