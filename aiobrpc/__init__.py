"""aiobrpc: brpc for Python — baidu_std client and server on asyncio, byte-compatible with C++ brpc.

>>> import aiobrpc
>>> aiobrpc.ChannelOptions(timeout_ms=500).timeout_ms
500
"""

from __future__ import annotations

from . import errors
from .client.backup import BackupRequestPolicy, LatencyQuantileBackupPolicy, RateLimitedBackupPolicy
from .client.channel import Channel
from .client.retry import FixedBackoffRetryPolicy, JitteredBackoffRetryPolicy, RetryPolicy, RetryThrottle
from .controller import Controller
from .errors import LocalProtocolError, RemoteProtocolError, RpcError
from .options import ChannelOptions, ServerOptions
from .server.server import Server
from .stub import Servicer, Stub

__all__ = [
    "BackupRequestPolicy", "Channel", "ChannelOptions", "Controller", "FixedBackoffRetryPolicy",
    "JitteredBackoffRetryPolicy", "LatencyQuantileBackupPolicy", "LocalProtocolError",
    "RateLimitedBackupPolicy", "RemoteProtocolError", "RetryPolicy", "RetryThrottle", "RpcError",
    "Server", "ServerOptions", "Servicer", "Stub", "errors", "event_loop_policy",
]
__version__ = "0.1.0"


def event_loop_policy():
    """uvloop's policy when uvloop is installed (the default loop of aiobrpc), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        import asyncio
        return asyncio.DefaultEventLoopPolicy()
    return uvloop.EventLoopPolicy()
