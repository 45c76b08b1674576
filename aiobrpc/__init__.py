"""aiobrpc: brpc for Python — baidu_std client and server on asyncio, byte-compatible with C++ brpc.

>>> import aiobrpc
>>> aiobrpc.ChannelOptions(timeout_ms=500).timeout_ms
500
"""

from __future__ import annotations

import logging

from . import _compiled

_compiled.install()  # first: AIOBRPC_NO_EXTENSIONS=1 must load the pure sources

# A library leaves its log's output to the application: without this, a program that set no
# logging up would get every WARNING on stderr from Python's last-resort handler.
logging.getLogger(__name__).addHandler(logging.NullHandler())

from . import errors
from .client.backup import BackupRequestPolicy, LatencyQuantileBackupPolicy, RateLimitedBackupPolicy
from .client.channel import Channel
from .client.grpc_stream import ResponseStream
from .client.combo import (CallMapper, DynamicPartitionChannel, MergeResult, ParallelChannel, ParallelChannelOptions,
                           Partition, PartitionChannel, PartitionChannelOptions, PartitionParser, ResponseMerger,
                           SelectiveChannel, SubCall)
from .client.retry import FixedBackoffRetryPolicy, JitteredBackoffRetryPolicy, RetryPolicy, RetryThrottle
from .controller import Controller
from .errors import LocalProtocolError, RemoteProtocolError, RpcError
from .options import ChannelOptions, ServerOptions
from .registration import EtcdRegistration
from .server.server import Server
from .stream import Stream, StreamHandler
from .stub import RpcChannel, Servicer, Stub
from .tls import ClientTlsOptions, ServerTlsOptions

__all__ = [
    "BackupRequestPolicy", "CallMapper", "Channel", "ChannelOptions", "ClientTlsOptions", "Controller",
    "DynamicPartitionChannel", "EtcdRegistration", "FixedBackoffRetryPolicy", "JitteredBackoffRetryPolicy",
    "LatencyQuantileBackupPolicy", "LocalProtocolError", "MergeResult", "ParallelChannel",
    "ParallelChannelOptions", "Partition", "PartitionChannel", "PartitionChannelOptions", "PartitionParser",
    "RateLimitedBackupPolicy", "RemoteProtocolError", "ResponseMerger", "ResponseStream", "RetryPolicy",
    "RetryThrottle",
    "RpcChannel", "RpcError", "SelectiveChannel", "Server", "ServerOptions", "ServerTlsOptions", "Servicer",
    "Stream", "StreamHandler", "Stub", "SubCall", "errors", "event_loop_policy", "implementation",
]
__version__ = "0.1.0"


def implementation() -> str:
    """Which build of the hot path this process runs: "cython" (the compiled extensions) or
    "python" (the same sources as Python: extensions not built, or AIOBRPC_NO_EXTENSIONS=1 set).

    It names the build of the `aiobrpc._fast` kernels; every other module compiled in place
    (`aiobrpc._compiled.compiled()` lists them all) is chosen with them, once per process."""
    from . import _fast
    return _fast.IMPLEMENTATION


def event_loop_policy():
    """uvloop's policy when uvloop is installed (the default loop of aiobrpc), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        import asyncio
        return asyncio.DefaultEventLoopPolicy()
    return uvloop.EventLoopPolicy()
