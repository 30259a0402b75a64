"""The sockets `edgechat serve` listens on: one per address of `--host` (IPv4 and IPv6 loopback
together, say), bound before the model loads so a wrong address fails at once, and all served by
one uvicorn server."""

from __future__ import annotations

import socket

from edgechat.errors import UsageError


def parse_hosts(value: str) -> list[str]:
    """`--host A[,B...]`: the addresses, in order, each once; IPv6 ones may come in brackets."""
    hosts = [h.strip().removeprefix("[").removesuffix("]") for h in value.split(",")]
    if not all(hosts):
        raise UsageError(f"--host wants one address or several separated by commas (127.0.0.1,::1), not {value!r}")
    return list(dict.fromkeys(hosts))


def bind(hosts: list[str], port: int) -> list[socket.socket]:
    """A listening socket on `port` for each host (port 0: one free port, the same for all)."""
    sockets: list[socket.socket] = []
    try:
        for host in hosts:
            sockets.append(_bind_one(host, port))
            port = port or sockets[0].getsockname()[1]
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _bind_one(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise UsageError(f"cannot listen on {host!r}: {exc.strerror}; give an address of this machine to --host") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            # '::' must not take IPv4 too: '--host 0.0.0.0,::' binds both
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {url_host(host)}:{port}: {exc.strerror}; pick another --host or --port") from None
    return sock


def url_host(host: str) -> str:
    """The host as a URL writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def serve(app, sockets: list[socket.socket]) -> None:
    """Run uvicorn on the bound sockets until Ctrl+C or SIGTERM."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5))
    try:
        server.run(sockets=sockets)
    except KeyboardInterrupt:
        pass  # uvicorn raises the signal again once it has shut down; Ctrl+C is how a server stops
