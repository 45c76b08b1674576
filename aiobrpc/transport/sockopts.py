"""TCP keepalive and TCP_USER_TIMEOUT on a connection's socket, as a channel's or a server's
options ask (both have socket_keepalive, socket_keepalive_idle_s, socket_keepalive_interval_s,
socket_keepalive_count and tcp_user_timeout_ms)."""

from __future__ import annotations

import logging
import socket

log = logging.getLogger(__name__)


def set_socket_options(transport, options) -> None:
    """TCP keepalive and TCP_USER_TIMEOUT as `options` ask; a socket that refuses one is logged
    and used as it is (the options tune failure detection, they are not needed to talk)."""
    wanted = []
    if options.socket_keepalive:
        wanted.append((socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1))
        for name, value in (("TCP_KEEPIDLE", options.socket_keepalive_idle_s),
                            ("TCP_KEEPINTVL", options.socket_keepalive_interval_s),
                            ("TCP_KEEPCNT", options.socket_keepalive_count)):
            if value > 0 and hasattr(socket, name):
                wanted.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    if options.tcp_user_timeout_ms > 0 and hasattr(socket, "TCP_USER_TIMEOUT"):
        wanted.append((socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, options.tcp_user_timeout_ms))
    if not wanted:
        return
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return
    for level, name, value in wanted:
        try:
            sock.setsockopt(level, name, value)
        except OSError as e:
            log.warning("cannot set socket option %s=%s on %s: %s", name, value, sock, e)
