"""ChannelOptions and ServerOptions, named as brpc names them (brpc's docs/en/client.md, brpc's docs/en/server.md).

Also the settings objects these options hold by default or check when they are made: the
`RetryThrottle` (a new one is every ChannelOptions' default) and the circuit breaker's settings
(`circuit_breaker_settings`). They live here, not in `client/`, so that this module, like
`errors.py` and `controller.py`, imports nothing from `client/` or `server/`: every layer uses
it, and it uses none of them.
"""

from __future__ import annotations

import ssl as ssl_module
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .interceptors import checked_interceptors
from .limiters import make_limiter
from .tls import ServerTlsOptions, client_context

CONNECTION_TYPES = ("single", "pooled", "short")
# ChannelOptions.protocol values, and brpc's spellings of them.
PROTOCOLS = ("baidu_std", "grpc")
_PROTOCOL_ALIASES = {"h2:grpc": "grpc"}


@dataclass
class ChannelOptions:
    """Client options. Times are milliseconds; -1 means "no limit" as in brpc.

    Every value is checked when the options are made (ValueError or TypeError naming the
    field). `timeout_ms`, `max_retry`, `backup_request_ms` and `connection_type` can be
    overridden per call in the `Controller`.

    >>> ChannelOptions(timeout_ms=100, max_retry=0).timeout_ms
    100

    Attributes:
        timeout_ms: The deadline of a call, covering connects, every retry, backoffs and the
            backup request; a call past it fails with ERPCTIMEDOUT. -1: none.
        connect_timeout_ms: The limit of one TCP connect (ETIMEDOUT when it passes, a retryable
            failure); the call's deadline still applies. -1: none.
        max_retry: Retries a call may make after its first attempt (0..1000); the backup request
            counts as one. Only brpc's retryable codes are retried (`retry_policy`).
        backup_request_ms: Send the same request again (to another server when there is one) when
            no reply came within this delay; the first reply wins. -1: no backup request.
        connection_type: "single" (one connection per server, calls multiplexed on it),
            "pooled" (one call per connection at a time) or "short" (a connection per attempt).
        max_body_size: The largest frame accepted from a server; a larger one breaks the
            connection (EFAILEDSOCKET for the calls on it).
        max_decompressed_size: The largest response data after decompression; a larger one
            fails that call with ERESPONSE.
        max_unwritten_bytes: Backpressure: the bytes a connection may hold not yet written to the
            socket (queued by aiobrpc plus the transport's buffer). An attempt that finds its
            connection over it is not sent and fails with EOVERCROWDED, which is retried (on
            another server when there is one) while retries and time are left.
        auth: An authenticator: an object with `generate_credential() -> bytes` (may be async),
            whose credential goes with the first request of every new connection. None: none.
        use_full_service_name: Send the service's full name ("example.EchoService"), as
            brpc's `-baidu_protocol_use_fullname` does by default; False sends "EchoService".
        deliver_timeout_ms: Tell the server the time left to the deadline in each request
            (brpc's `-baidu_std_protocol_deliver_timeout_ms`); the handler reads it as
            `cntl.timeout_ms`.
        retry_policy: A `RetryPolicy` deciding which failures are retried and the backoff before
            each retry. None: brpc's default set of codes, no backoff.
        retry_throttle: A `RetryThrottle` shared by the channel's calls (gRPC A6): retries stop
            while most attempts fail, so a dead cluster does not get max_retry + 1 times the
            load. The default is a new `RetryThrottle()`; None: no throttle.
        backup_request_policy: A `BackupRequestPolicy` (such as `LatencyQuantileBackupPolicy`);
            wins over `backup_request_ms`.
        non_idempotent_methods: Names ("package.Service/Method", or "package.Service" for all
            its methods) whose work must not be repeated: never retried once the request may
            have reached the server, and never given a backup request.
            `Controller.idempotent` overrides it per call.
        method_status: Keep each method's figures (count, QPS, errors, latency percentiles,
            retries, backup requests) for `Channel.status()` and the Prometheus collector
            (`aiobrpc.client.prometheus.ChannelCollector`); False spares their recording, and
            they show no calls.
        enable_circuit_breaker: Isolate a server whose recent calls mostly fail (brpc's two EMA
            windows); the health check revives it.
        circuit_breaker_options: Keyword arguments of the circuit breaker (windows, error
            percents, isolation durations); brpc's gflag defaults otherwise.
        health_check_interval_s: The longest wait between two health-check connects to a down
            server (brpc's `-health_check_interval`); checks start sooner and back off to it.
        health_check_timeout_ms: The limit of one health-check connect. -1: none.
        max_connection_pool_size: Idle pooled connections kept per server.
        pool_idle_timeout_s: Seconds an idle pooled connection is kept before it is closed
            (brpc's `-idle_timeout_second`).
        ssl: TLS to every server: None or False (plaintext), True (the system's trusted CAs,
            the server's name verified), a `ClientTlsOptions` (a CA file, a client certificate
            for mutual TLS) or an `ssl.SSLContext` used as is. A failed handshake fails the
            call with ESSL; a channel with TLS never falls back to plaintext.
        ssl_handshake_timeout_ms: The limit of one TLS handshake (ESSL past it); the call's
            deadline still applies.
        connection_group: Channels (of one event loop) to the same server share its
            connections, health check and circuit breaker when their connection options are
            equal; channels of different groups never do (brpc's `connection_group`).
        interceptors: Async callables `(request, cntl, proceed)` around every call of the
            channel, the first outermost (`aiobrpc.interceptors` tells the rules).
        socket_keepalive: TCP keepalive on the channel's connections (brpc's
            `-socket_keepalive`), so a peer that vanished without a FIN (a host powered off, a
            NAT that forgot the flow) is found while the connection is idle.
        socket_keepalive_idle_s, socket_keepalive_interval_s, socket_keepalive_count: Idle
            seconds before the first probe, seconds between probes, probes unanswered before the
            connection is dropped (TCP_KEEPIDLE, TCP_KEEPINTVL, TCP_KEEPCNT); -1: the system's.
        tcp_user_timeout_ms: Milliseconds sent data may stay unacknowledged before the kernel
            drops the connection (TCP_USER_TIMEOUT, Linux; brpc's `-socket_tcp_user_timeout_ms`);
            -1: the system's.
        protocol: "baidu_std" (brpc's own) or "grpc" (brpc's "h2:grpc" is accepted and becomes
            "grpc"): gRPC over HTTP/2 to any gRPC server, each call an HTTP/2 stream, with the
            same deadlines, retries, backup requests and load balancing; TLS offers ALPN "h2".
            gRPC carries the request message only: a call with a request attachment or
            `aiobrpc.Stream`s fails with EREQUEST. Streaming rpcs are called through
            `aiobrpc.Stub` over gRPC only (docs/grpc.md, "Client").
    """

    timeout_ms: int = 500
    connect_timeout_ms: int = 200
    max_retry: int = 3
    backup_request_ms: int = -1
    connection_type: str = "single"
    max_body_size: int = 64 * 1024 * 1024
    max_decompressed_size: int = 64 * 1024 * 1024
    max_unwritten_bytes: int = 64 * 1024 * 1024
    auth: Any = None  # an object with generate_credential() -> bytes (may be async)
    use_full_service_name: bool = True  # brpc's -baidu_protocol_use_fullname
    deliver_timeout_ms: bool = False  # brpc's -baidu_std_protocol_deliver_timeout_ms
    retry_policy: Any = None  # a client.retry.RetryPolicy; None: brpc's default set, no backoff
    # Token bucket shared by the channel's calls (gRPC A6): retries stop while most attempts
    # fail, so a dead cluster does not get max_retry+1 times the load. None: no throttle.
    retry_throttle: Any = field(default_factory=lambda: RetryThrottle())
    backup_request_policy: Any = None  # a client.backup.BackupRequestPolicy; wins over backup_request_ms
    # Methods ("package.Service/Method", or "package.Service" for all of its methods) whose
    # work must not be repeated: never retried once the request may have reached the server,
    # and never given a backup request. Controller.idempotent overrides per call.
    non_idempotent_methods: frozenset = frozenset()
    method_status: bool = True
    enable_circuit_breaker: bool = False
    # CircuitBreaker keyword arguments (windows, error percents, isolation durations); brpc's
    # gflag defaults otherwise.
    circuit_breaker_options: dict = field(default_factory=dict)
    health_check_interval_s: float = 3.0  # brpc's -health_check_interval
    health_check_timeout_ms: int = 500
    max_connection_pool_size: int = 100  # idle pooled connections kept per server
    pool_idle_timeout_s: float = 30.0  # brpc's -idle_timeout_second for pooled connections
    ssl: Any = None  # None/False, True, a tls.ClientTlsOptions or an ssl.SSLContext
    ssl_handshake_timeout_ms: int = 5000
    connection_group: str = ""  # channels of different groups never share connections
    interceptors: Sequence = ()  # async (request, cntl, proceed) -> response, first outermost
    socket_keepalive: bool = False
    socket_keepalive_idle_s: int = -1  # -1: the system's
    socket_keepalive_interval_s: int = -1
    socket_keepalive_count: int = -1
    tcp_user_timeout_ms: int = -1
    protocol: str = "baidu_std"  # or "grpc" (brpc's "h2:grpc")

    def __post_init__(self) -> None:
        _check_ms("timeout_ms", self.timeout_ms)
        if not isinstance(self.protocol, str):
            raise TypeError(f"protocol must be a str, got {type(self.protocol).__name__}")
        self.protocol = _PROTOCOL_ALIASES.get(self.protocol, self.protocol)
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS} (or brpc's 'h2:grpc'), got {self.protocol!r}")
        self.interceptors = checked_interceptors("interceptors", self.interceptors)
        _check_socket_options(self)
        if not isinstance(self.connection_group, str):
            raise TypeError(f"connection_group must be a str, got {type(self.connection_group).__name__}")
        if not _is_int(self.ssl_handshake_timeout_ms) or self.ssl_handshake_timeout_ms < 1:
            raise ValueError(f"ssl_handshake_timeout_ms must be an int >= 1, got {self.ssl_handshake_timeout_ms!r}")
        client_context(self.ssl)  # TypeError naming what is wrong; files are read when connecting
        _check_ms("connect_timeout_ms", self.connect_timeout_ms)
        _check_ms("backup_request_ms", self.backup_request_ms)
        _check_ms("health_check_timeout_ms", self.health_check_timeout_ms)
        if not isinstance(self.max_retry, int) or self.max_retry < 0:
            raise ValueError(f"max_retry must be an int >= 0, got {self.max_retry!r}")
        if self.max_retry > 1000:  # brpc's cap per call
            raise ValueError(f"max_retry must be <= 1000, got {self.max_retry}")
        if self.connection_type not in CONNECTION_TYPES:
            raise ValueError(f"connection_type must be one of {CONNECTION_TYPES}, got {self.connection_type!r}")
        for name in ("max_body_size", "max_decompressed_size", "max_unwritten_bytes"):
            _check_size(name, getattr(self, name))
        for name in ("health_check_interval_s", "pool_idle_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {v!r}")
        if not isinstance(self.max_connection_pool_size, int) or self.max_connection_pool_size < 0:
            raise ValueError(f"max_connection_pool_size must be an int >= 0, got {self.max_connection_pool_size!r}")
        if isinstance(self.non_idempotent_methods, str):
            raise ValueError("non_idempotent_methods must be a collection of names, not one str")
        self.non_idempotent_methods = frozenset(self.non_idempotent_methods)
        if not isinstance(self.circuit_breaker_options, dict):
            raise TypeError("circuit_breaker_options must be a dict of CircuitBreaker arguments")
        if self.circuit_breaker_options:
            try:
                circuit_breaker_settings(self.circuit_breaker_options)  # the breaker's own checks, now
            except TypeError as e:
                raise TypeError(f"circuit_breaker_options: {e}") from None
        for name, want in (("retry_policy", "do_retry"), ("backup_request_policy", "backup_request_ms"),
                           ("retry_throttle", "allow_retry")):
            v = getattr(self, name)
            if v is not None and not hasattr(v, want):
                raise TypeError(f"{name} must have a {want}() method, got {type(v).__name__}")


class RetryThrottle:
    """Token bucket that stops retries while a server mostly fails (gRPC proposal A6).

    Tokens start at `max_tokens`; each failed attempt takes 1 (not below 0), each success
    gives back `token_ratio` (not above `max_tokens`); retries are allowed only while more
    than half the tokens are left. One throttle is meant to be shared by all calls to a
    cluster.

    >>> t = RetryThrottle(max_tokens=4, token_ratio=0.5)
    >>> t.on_failure(); t.allow_retry()
    True
    >>> t.on_failure(); t.allow_retry()
    False
    >>> t.on_success(); t.allow_retry()
    True
    """

    def __init__(self, max_tokens: float = 100, token_ratio: float = 0.1) -> None:
        if not (isinstance(max_tokens, (int, float)) and 0 < max_tokens <= 1000):
            raise ValueError(f"max_tokens must be in (0, 1000], got {max_tokens!r}")
        if not (isinstance(token_ratio, (int, float)) and 0 < token_ratio <= max_tokens):
            raise ValueError(f"token_ratio must be > 0 and <= max_tokens, got {token_ratio!r}")
        self.max_tokens = float(max_tokens)
        self.token_ratio = float(token_ratio)
        self.tokens = self.max_tokens

    def on_success(self) -> None:
        """An attempt succeeded: give back `token_ratio` tokens."""
        self.tokens = min(self.max_tokens, self.tokens + self.token_ratio)

    def on_failure(self) -> None:
        """An attempt failed: take one token."""
        self.tokens = max(0.0, self.tokens - 1)

    def allow_retry(self) -> bool:
        """Whether a retry may be made now: more than half the tokens are left."""
        return self.tokens > self.max_tokens / 2

    def __repr__(self) -> str:
        return f"<RetryThrottle {self.tokens:g}/{self.max_tokens:g} tokens>"



#: brpc's circuit-breaker gflags (src/brpc/circuit_breaker.cpp), the defaults of
#: `client.circuit_breaker.CircuitBreaker` and of `ChannelOptions.circuit_breaker_options`.
CIRCUIT_BREAKER_DEFAULTS: dict[str, Any] = {
    "long_window": 3000, "long_error_percent": 5, "short_window": 1500, "short_error_percent": 10,
    "epsilon": 0.02, "min_error_cost_us": 500, "max_failed_latency_multiple": 2.0,
    "min_isolation_ms": 100, "max_isolation_ms": 30000, "half_open_window": 0,
}


def circuit_breaker_settings(options: dict[str, Any]) -> dict[str, Any]:
    """`CIRCUIT_BREAKER_DEFAULTS` updated by `options`, checked: TypeError names a setting that
    does not exist, ValueError a value out of its range.

    >>> circuit_breaker_settings({"short_window": 10})["short_window"]
    10
    """
    unknown = options.keys() - CIRCUIT_BREAKER_DEFAULTS.keys()
    if unknown:
        raise TypeError(f"unexpected circuit breaker setting(s) {', '.join(sorted(map(repr, unknown)))}")
    s = {**CIRCUIT_BREAKER_DEFAULTS, **options}
    for name in ("long_window", "short_window"):
        if not _is_int(s[name]) or s[name] < 1:
            raise ValueError(f"{name} must be an int >= 1 (samples), got {s[name]!r}")
    for name in ("long_error_percent", "short_error_percent"):
        if not _is_int(s[name]) or not 0 <= s[name] <= 100:
            raise ValueError(f"{name} must be an int in 0..100, got {s[name]!r}")
    epsilon = s["epsilon"]
    if not (isinstance(epsilon, (int, float)) and 0 < epsilon < 1):
        raise ValueError(f"epsilon must be in (0, 1), got {epsilon!r}")
    min_error_cost_us = s["min_error_cost_us"]
    if not (isinstance(min_error_cost_us, (int, float)) and min_error_cost_us >= 0):
        raise ValueError(f"min_error_cost_us must be >= 0, got {min_error_cost_us!r}")
    multiple = s["max_failed_latency_multiple"]
    if not (isinstance(multiple, (int, float)) and multiple > 0):
        raise ValueError(f"max_failed_latency_multiple must be > 0, got {multiple!r}")
    min_isolation_ms, max_isolation_ms = s["min_isolation_ms"], s["max_isolation_ms"]
    if not _is_int(min_isolation_ms) or min_isolation_ms < 1:
        raise ValueError(f"min_isolation_ms must be an int >= 1, got {min_isolation_ms!r}")
    if not _is_int(max_isolation_ms) or max_isolation_ms < min_isolation_ms:
        raise ValueError(f"max_isolation_ms must be an int >= min_isolation_ms "
                         f"({min_isolation_ms}), got {max_isolation_ms!r}")
    if not _is_int(s["half_open_window"]) or s["half_open_window"] < 0:
        raise ValueError(f"half_open_window must be an int >= 0 (0: off), got {s['half_open_window']!r}")
    return s


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class ServerOptions:
    """Server options.

    >>> ServerOptions(max_concurrency=100).max_concurrency
    100

    Attributes:
        max_concurrency: Requests handled at once by the whole server; one more is answered
            with ELIMIT (the client may retry it elsewhere). 0: no limit.
        max_body_size: The largest frame accepted from a client; a larger one closes the
            connection right after its header, before the body is read.
        max_decompressed_size: The largest request data after decompression; a larger one is
            answered with EREQUEST.
        max_unwritten_bytes: Backpressure: the bytes of replies a connection may hold not yet
            written to the socket. Past it, new requests on that connection are answered with
            EOVERCROWDED (their handlers do not run); while the client does not read, the
            server also stops reading its requests.
        auth: An authenticator: an object with `verify_credential(credential, peer) -> bool`
            (may be async), asked once per connection with the first request's credential
            (baidu_std's `authentication_data`, gRPC's `authorization` metadata); False answers
            ERPCAUTH and closes the connection. Over HTTP/1.1 every request must carry its
            credential in `Authorization` (a connection asks again only for a new one); none or
            a refused one answers 401 and closes; builtin pages are exempt on the internal port
            only. The handler sees the credential as `cntl.authentication_data`. An optional
            `unauthorized_error_text() -> str` is appended to "Fail to authenticate" in what a
            refused peer gets (brpc's GetUnauthorizedErrorText). None: no authentication.
        idle_timeout_sec: Close a connection that has no request in flight and received
            nothing for this many seconds. -1 (or any value <= 0): never. Whatever it is, a
            connection idle for a second gives its 256 KiB read block back (the next read
            makes another), so an idle connection costs ~4 KB.
        first_frame_timeout_sec: Close a new connection that sends no complete frame within
            this many seconds (stricter than brpc, which waits).
        max_connections: Connections open at once; one more is closed at once.
        handler_threads: Threads of the pool that runs plain `def` handlers.
        server_tag: The "[ip:port]" prefix of the error texts sent to clients; default: the
            connection's local address, as brpc.
        has_builtin_services: Serve the builtin pages (/status, /vars, /brpc_metrics, /health,
            /version, /flags, /protobufs, /connections, /index) over HTTP on the server's port.
        rpcz: Keep the last `rpcz_max_records` calls (method, peer, trace ids, latency, error)
            for the /rpcz page, as brpc's -enable_rpcz.
        rpcz_max_records: How many calls /rpcz keeps (the oldest leave first).
        internal_port: -1: the builtin pages are on the server's port. Otherwise they are
            served only on this port (0: any free one, then read `Server.internal_port`), on
            the server's host, and the server's port answers them 403 (EPERM): for servers
            that untrusted clients reach. Both ports serve the methods.
        version: What /version answers; default: the servicers' class names joined by "+".
        method_max_concurrency: The concurrency limiter of every method (a method's own, set
            with `Server.max_concurrency_of`, replaces it): 0 or "unlimited" (none), an int N,
            "auto", "timeout", or {"timeout_ms": T, "max_concurrency": N}; past it a request
            is answered with ELIMIT naming the method (docs/server.md).
        max_user_fields: The most `user_fields` entries a request may carry; more is answered
            with EREQUEST. At most 1024 (`_fast.MAX_USER_FIELDS`): past that the decoder stops
            keeping them, so a frame of 100k tiny entries costs no more memory than 1025.
        max_user_fields_bytes: The most bytes (keys and values) a request's `user_fields` may
            hold; more is answered with EREQUEST. brpc has neither limit.
        method_status: Keep each method's figures (count, QPS, errors, latency percentiles,
            concurrency) for /status, /vars and /brpc_metrics; False spares about 0.4 us of
            CPU per call, and those pages then show no calls.
        ssl: TLS on the server's port(s): a `ServerTlsOptions` (certificate, key, and for
            mutual TLS the CAs of client certificates) or an `ssl.SSLContext`. A connection
            whose first bytes are a TLS handshake is served over TLS, and what it speaks
            inside (baidu_std, HTTP) is detected again; others are served in plaintext
            unless `force_ssl`. None: TLS connections are closed.
        socket_keepalive: TCP keepalive on accepted connections, so that a client that
            vanished without a FIN or RST (a host powered off, a NAT that forgot the flow, a
            reset lost on the way) is found and its connection, calls and streams ended, even
            with no idle timeout. On by default (stricter than brpc, whose -socket_keepalive is
            off): a dead client is found after socket_keepalive_idle_s plus
            socket_keepalive_count probes socket_keepalive_interval_s apart (90 s).
        socket_keepalive_idle_s, socket_keepalive_interval_s, socket_keepalive_count: As the
            channel's (TCP_KEEPIDLE, TCP_KEEPINTVL, TCP_KEEPCNT); -1: the system's.
        tcp_user_timeout_ms: Milliseconds a reply's bytes may stay unacknowledged before the
            kernel drops the connection (TCP_USER_TIMEOUT, Linux); -1: the system's.
        force_ssl: Close every connection that does not start with a TLS handshake. None
            (default): True exactly when `ssl` requires client certificates
            (`verify_client="required"`, or an SSLContext with `verify_mode` CERT_REQUIRED), so
            that mutual TLS cannot be skipped by not using TLS (stricter than brpc); False
            serves plaintext beside mutual TLS all the same, as brpc does.
        ssl_handshake_timeout_sec: Close a TLS connection whose handshake has not completed
            within this many seconds (asyncio's default would be 60).
        extra: Free-form settings kept with the options; aiobrpc reads none of them.
        interceptors: Async callables `(request, cntl, proceed)` around every request's
            handler, the first outermost (`aiobrpc.interceptors` tells the rules); read when
            the server starts.
        grpc_health: Serve the standard gRPC health service (`grpc.health.v1.Health`: Check,
            List, Watch) to gRPC clients: every service SERVING, and the whole server ("")
            too, until the server stops (docs/grpc.md).
        grpc_reflection: Serve gRPC server reflection (`grpc.reflection.v1alpha` and `v1`), so
            that tools such as grpcurl list the services and read their .proto definitions.
    """

    max_concurrency: int = 0  # 0 = unlimited
    max_body_size: int = 64 * 1024 * 1024
    max_decompressed_size: int = 64 * 1024 * 1024
    max_unwritten_bytes: int = 64 * 1024 * 1024
    auth: Any = None  # an object with verify_credential(credential, peer) -> bool (may be async)
    idle_timeout_sec: float = -1
    first_frame_timeout_sec: float = 10.0  # stricter than brpc: a silent new connection is closed
    max_connections: int = 10000
    handler_threads: int = 8  # thread pool for plain-def handlers
    server_tag: str | None = None  # "[ip:port]" prefix of error texts; default: the local address
    has_builtin_services: bool = True
    version: str = ""
    internal_port: int = -1
    rpcz: bool = False
    rpcz_max_records: int = 1000
    method_status: bool = True
    method_max_concurrency: Any = 0
    max_user_fields: int = 1024
    max_user_fields_bytes: int = 1 << 20
    ssl: Any = None  # a tls.ServerTlsOptions or an ssl.SSLContext
    force_ssl: bool | None = None  # None: True when ssl requires client certificates
    socket_keepalive: bool = True  # stricter than brpc: dead clients are found
    socket_keepalive_idle_s: int = 60
    socket_keepalive_interval_s: int = 10
    socket_keepalive_count: int = 3
    tcp_user_timeout_ms: int = -1
    ssl_handshake_timeout_sec: float = 5.0
    extra: dict = field(default_factory=dict)
    interceptors: Sequence = ()  # async (request, cntl, proceed) -> response, first outermost
    grpc_health: bool = False
    grpc_reflection: bool = False

    def __post_init__(self) -> None:
        self.interceptors = checked_interceptors("interceptors", self.interceptors)
        for name in ("grpc_health", "grpc_reflection"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.ssl is not None and not isinstance(self.ssl, (ssl_module.SSLContext, ServerTlsOptions)):
            raise TypeError(f"ssl must be None, a ServerTlsOptions or an ssl.SSLContext, got {type(self.ssl).__name__}")
        _check_socket_options(self)
        if self.force_ssl is not None and not isinstance(self.force_ssl, bool):
            raise TypeError(f"force_ssl must be None, True or False, got {self.force_ssl!r}")
        if self.force_ssl and self.ssl is None:
            raise ValueError("force_ssl=True needs ssl: the server's certificate and key")
        if isinstance(self.ssl_handshake_timeout_sec, bool) or not isinstance(self.ssl_handshake_timeout_sec, (int, float)) \
                or not self.ssl_handshake_timeout_sec > 0:
            raise ValueError(f"ssl_handshake_timeout_sec must be a number of seconds > 0, "
                             f"got {self.ssl_handshake_timeout_sec!r}")
        if not isinstance(self.max_concurrency, int) or self.max_concurrency < 0:
            raise ValueError(f"max_concurrency must be an int >= 0, got {self.max_concurrency!r}")
        for name in ("max_body_size", "max_decompressed_size", "max_unwritten_bytes"):
            _check_size(name, getattr(self, name))
        if not _is_number(self.first_frame_timeout_sec) or not self.first_frame_timeout_sec > 0:
            raise ValueError(f"first_frame_timeout_sec must be a number of seconds > 0, "
                             f"got {self.first_frame_timeout_sec!r}")
        if not _is_number(self.idle_timeout_sec):  # <= 0: never, as brpc's -idle_timeout_second
            raise ValueError(f"idle_timeout_sec must be a number of seconds (<= 0: never), "
                             f"got {self.idle_timeout_sec!r}")
        for name in ("max_connections", "handler_threads"):
            if not _is_int(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not _is_int(self.rpcz_max_records) or self.rpcz_max_records < 1:
            raise ValueError(f"rpcz_max_records must be an int >= 1, got {self.rpcz_max_records!r}")
        if not _is_int(self.internal_port) or not -1 <= self.internal_port <= 65535:
            raise ValueError(f"internal_port must be -1 (none) or a port in 0..65535, got {self.internal_port!r}")
        make_limiter(self.method_max_concurrency)  # ValueError naming what is wrong
        if not _is_int(self.max_user_fields) or not 0 <= self.max_user_fields <= 1024:
            raise ValueError(f"max_user_fields must be an int in 0..1024, got {self.max_user_fields!r}")
        if not _is_int(self.max_user_fields_bytes) or self.max_user_fields_bytes < 0:
            raise ValueError(f"max_user_fields_bytes must be an int >= 0, got {self.max_user_fields_bytes!r}")


def _check_socket_options(options) -> None:
    if not isinstance(options.socket_keepalive, bool):
        raise TypeError(f"socket_keepalive must be a bool, got {options.socket_keepalive!r}")
    for name in ("socket_keepalive_idle_s", "socket_keepalive_interval_s", "socket_keepalive_count",
                 "tcp_user_timeout_ms"):
        v = getattr(options, name)
        if not _is_int(v) or not (v == -1 or 0 < v <= 0x7FFFFFFF):
            raise ValueError(f"{name} must be -1 (the system's) or an int in 1..2147483647, got {v!r}")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def _check_ms(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or (v < 0 and v != -1) or v > 0x7FFFFFFF:
        raise ValueError(f"{name} must be -1 or an int in 0..2147483647, got {v!r}")


def _check_size(name: str, v) -> None:
    if not isinstance(v, int) or not 0 < v <= 0xFFFFFFFF:
        raise ValueError(f"{name} must be an int in 1..4294967295, got {v!r}")
