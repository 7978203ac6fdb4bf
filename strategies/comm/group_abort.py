"""Make the default group's collectives in flight fail at once, from any thread: abort the group.

A gloo collective blocked on a peer that is alive but no longer in it (a peer whose own collective failed,
with gloo's ring all-reduce: the members not next to a dead one) waits out the group's timeout, and a
process that leaves the group meanwhile waits for it too (the group's teardown waits for its work in
flight). torch's `ProcessGroup.abort()` ends NCCL's work; gloo's does nothing (torch 2.13: measured, a
blocked all-reduce still waited its 20 s timeout after it). What does end a gloo collective is its
connections closing, as when a peer dies: `abort_default_group` shuts the group's TCP connections down
(``shutdown(2)``, the descriptors stay gloo's), so every collective in flight on this process raises
"Connection closed" within milliseconds (measured: 1.0 s after a 1.0 s sleep, against 20 s), and so do its
peers' collectives with this process.

The group's connections are the sockets that joining it opened (`joined_group` takes the process's sockets
before and after), less those to or from the store's port. Where the process's descriptors cannot be read
(no ``/proc``), the abort is torch's alone and gloo's collectives end by their timeout, as before.

Closing the connections does not always end the collective in gloo's own thread: a ring all-reduce's send
or receive on the pair of a SIGKILLed peer can stay blocked until the group's timeout (seen in about one
local 3-worker run in three), and the group's destructor joins that thread. Wherever such a group's last
reference went (a garbage collection mid-run, the interpreter's exit after the stage), the process waited
out the timeout: 295 s of 300. `leave_default_group` therefore closes the group's connections, leaves it,
and keeps the group object for the life of the process, so that its destructor never runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import threading
from collections.abc import Iterator

import torch.distributed as dist

__all__ = ["abort_default_group", "joined_group", "leave_default_group"]

_FD_DIR = "/proc/self/fd"
_LOCK = threading.Lock()
#: The default group's connections: descriptor -> what it named when the group was joined ("socket:[inode]").
_SOCKETS: dict[int, str] = {}


def _sockets() -> dict[int, str]:
    """This process's open sockets (descriptor -> "socket:[inode]"); empty where /proc is not there."""
    found: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(_FD_DIR):
            with contextlib.suppress(OSError):
                target = os.readlink(f"{_FD_DIR}/{name}")
                if target.startswith("socket:"):
                    found[int(name)] = target
    return found


@contextlib.contextmanager
def joined_group(store_port: int | None = None) -> Iterator[None]:
    """Around `dist.init_process_group`: remember the connections it opens (not those of the store at `store_port`).

    The group joined replaces whatever an earlier one left: `abort_default_group` then closes these only.
    """
    before = _sockets()
    yield
    opened = {fd: target for fd, target in _sockets().items() if before.get(fd) != target}
    mine: dict[int, str] = {}
    for fd, target in opened.items():
        ends = _ends(fd)
        if ends is not None and store_port not in ends:
            mine[fd] = target
    with _LOCK:
        _SOCKETS.clear()
        _SOCKETS.update(mine)


def _ends(fd: int) -> tuple[int, int] | None:
    """The local and remote ports of a connected TCP socket `fd` (None: not one, e.g. gloo's listening socket)."""
    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as sock:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        return sock.getsockname()[1], sock.getpeername()[1]
    return None


def abort_default_group() -> int:
    """End every collective in flight on the default group now (safe from any thread); return connections closed.

    The group is unusable afterwards: leave it (`dist.destroy_process_group`) and join a new one. Its
    collectives raise as they would had the peers died, "Connection closed by peer".
    """
    if dist.is_initialized() and dist.get_backend() != "gloo":
        with contextlib.suppress(Exception):
            # NCCL's abort ends its kernels and communicators (what torchft does on an error).
            dist.group.WORLD.abort()  # type: ignore[union-attr]
    closed = 0
    with _LOCK:
        for fd, target in _SOCKETS.items():
            with contextlib.suppress(OSError):
                if os.readlink(f"{_FD_DIR}/{fd}") != target:
                    continue  # gloo closed it already and the number names another socket now
                # A duplicate of gloo's descriptor: shutting it down ends the connection for both, closing
                # the duplicate leaves gloo's open (it closes that when it tears the group down).
                with socket.socket(fileno=os.dup(fd)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
                    closed += 1
        _SOCKETS.clear()
    return closed


def leave_default_group() -> None:
    """Leave the default group at once: close its connections (peers blocked on this process fail now), destroy it
    in torch's registry, and keep its object alive for good, so that no thread ever waits on its destructor.

    A left group costs its sockets (shut down) and its idle threads; a run leaves one per recovery.
    """
    if not dist.is_initialized():
        return
    group = dist.group.WORLD
    abort_default_group()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    # One reference never released: not even the interpreter's exit deallocates the group (see the module).
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
