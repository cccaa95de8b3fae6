"""Where the server listens besides --host:--port: a unix socket (--uds-path), whose HTTP is the
same app's, and a port serving only the Prometheus metrics (--prometheus-port; /metrics stays on
the main port too, as in TEI). Both are bound before the server starts, so a path or port that
cannot be used exits 2 with one line like any bad flag.
"""

from __future__ import annotations

import socket
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server

from .settings import Settings


class ListenerError(ValueError):
    """--uds-path or --prometheus-port cannot be listened on."""


def unix_listener(path: Path) -> socket.socket:
    """A unix socket bound at `path`. A socket file nobody listens on any more (a server that was
    killed) is replaced; a live one, or any other file, is refused."""
    if path.is_socket():
        with socket.socket(socket.AF_UNIX) as probe:
            if probe.connect_ex(str(path)) == 0:
                raise ListenerError(f"cannot listen on unix socket {path}: another server listens on it")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise ListenerError(f"cannot listen on unix socket {path}: {exc.strerror}") from None
    return sock


class Listeners:
    """The extra listeners of one server, open until `close`."""

    def __init__(self, settings: Settings, registry: CollectorRegistry):
        self.uds_path = settings.uds_path
        self.unix = unix_listener(settings.uds_path) if settings.uds_path is not None else None
        self.metrics_server = None
        if settings.prometheus_port is not None:
            try:
                self.metrics_server, _ = start_http_server(settings.prometheus_port, settings.host, registry)
            except OSError as exc:
                self.close()
                raise ListenerError(f"cannot serve metrics on {settings.host}:{settings.prometheus_port}: "
                                    f"{exc.strerror}") from None

    def sockets(self, bind_main) -> list[socket.socket] | None:
        """What uvicorn should serve: None (it binds --host:--port itself) unless a unix socket is
        open, then the main socket (`bind_main()`) and that one."""
        return None if self.unix is None else [bind_main(), self.unix]

    def close(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.shutdown()
            self.metrics_server.server_close()
        if self.unix is not None:
            self.unix.close()
            self.uds_path.unlink(missing_ok=True)
