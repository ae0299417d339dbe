"""The server's listening socket, bound before the model loads (SRV-121).

Loading a checkpoint takes seconds to minutes; a port already in use found only after it
(when uvicorn binds) wastes them and reports the error after "startup complete". Binding first
and handing the socket to uvicorn fails at once, and leaves no window for another process to
take the port between a check and the bind.
"""

from __future__ import annotations

import errno
import socket

from pagedkv.errors import PagedKVError

#: Connections the kernel queues before the server accepts them (uvicorn's default).
BACKLOG = 2048


class CannotListen(PagedKVError):
    """The host and port cannot be bound (in use, not an address of this machine, ...)."""


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening, for uvicorn's ``run(sockets=...)``.

    Raises:
        CannotListen: the bind failed; the message names the address and why.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise CannotListen(f"cannot listen on {host}:{port}: {exc}") from exc
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        reason = "the port is in use" if exc.errno == errno.EADDRINUSE else str(exc.strerror)
        raise CannotListen(f"cannot listen on {host}:{port}: {reason}") from exc
    sock.set_inheritable(True)
    return sock
