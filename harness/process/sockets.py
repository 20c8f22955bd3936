"""This process's TCP connections: which are open, and shutting them down to end a blocked wait.

Why: a torchrun rank (`harness.session.torchrun_session`) cannot be killed to end a collective that can
never complete, as a pool rank is; it must go on to the next test. gloo gives no way to cancel a
wait in progress: `ProcessGroup.abort()` and `shutdown()` leave a blocked `wait()` waiting until
the collective timeout (measured on torch 2.13). What does end it at once is the connection under
it closing: gloo then fails every pending operation on that pair ("Connection closed by peer").
`shut_down_connections` does that with `shutdown(2)` on the socket (not `close`: the descriptor
stays gloo's, which closes it when the group is destroyed).

Sockets are named by identity (`socket:[inode]`, the target of /proc/self/fd/<fd>), which a
reused descriptor number cannot fake. Only connected TCP sockets are ever shut down: a listening
socket shut down under gloo's listener thread aborts the process. Linux only (/proc); elsewhere
no socket is found and nothing is shut down.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Collection, Iterator

__all__ = ["connected_tcp_ports", "open_sockets", "shut_down_connections"]

_FD_DIR = "/proc/self/fd"


def open_sockets() -> dict[str, int]:
    """Every socket this process holds: identity -> one descriptor of it ({} without /proc)."""
    found: dict[str, int] = {}
    try:
        names = os.listdir(_FD_DIR)
    except OSError:
        return found
    for name in names:
        with contextlib.suppress(OSError, ValueError):
            target = os.readlink(f"{_FD_DIR}/{name}")
            if target.startswith("socket:"):
                found.setdefault(target, int(name))
    return found


def connected_tcp_ports(identity: str, fd: int) -> tuple[int, int] | None:
    """(local port, peer port) of socket `identity` held as `fd`, None unless it is a connected
    TCP socket (a listening one, a UNIX socket, a descriptor reused for something else)."""
    with _borrowed(identity, fd) as sock:
        if sock is None or sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        try:
            return sock.getsockname()[1], sock.getpeername()[1]
        except OSError:  # not connected: a listener
            return None
    return None


def shut_down_connections(keep: Collection[str]) -> list[str]:
    """Shut down (both directions) every connected TCP socket of this process not in `keep`;
    the identities of those shut down."""
    done: list[str] = []
    for identity, fd in open_sockets().items():
        if identity in keep or connected_tcp_ports(identity, fd) is None:
            continue
        with _borrowed(identity, fd) as sock:
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                    done.append(identity)
    return done


@contextlib.contextmanager
def _borrowed(identity: str, fd: int) -> Iterator[socket.socket | None]:
    """A socket object on a duplicate of `fd` (the original stays its owner's), or None when `fd`
    no longer holds `identity`."""
    try:
        duplicate = os.dup(fd)
    except OSError:
        yield None
        return
    try:
        if os.readlink(f"{_FD_DIR}/{duplicate}") != identity:
            yield None
            return
        sock = socket.socket(fileno=duplicate)
    except OSError:
        os.close(duplicate)
        yield None
        return
    try:
        yield sock
    finally:
        sock.close()  # closes the duplicate only
