"""brpc error codes (brpc's src/brpc/errno.proto) and the exceptions aiobrpc raises.

`RpcError` is what a failed call raises and what a handler raises to fail its call.
`RemoteProtocolError` means the peer sent bytes we cannot accept; `LocalProtocolError` means
our own caller misused the API. Numbers are brpc's (and Linux errno values, which brpc uses on
the wire whatever the host platform is).

The codes a caller meets most, and the ones a handler raises ("retried": in brpc's default
retry set, `DEFAULT_RETRYABLE`; a call is retried only while `max_retry` and its deadline allow):

| code | number | meaning | retried |
|---|---|---|---|
| `EREQUEST` | 1003 | bad request: what a handler raises for invalid input; also a request that could not be serialized or packed (a non-contiguous attachment), or that the server could not parse | never |
| `EINTERNAL` | 2001 | the handler failed: any exception other than RpcError is sent as this; on the client, a user callback (retry or backup policy, load balancer) raised, which ends that call alone (logged once) | no |
| `ERESPONSE` | 2002 | bad response: not parsed by the client, or a handler returned the wrong type | no |
| `ENOSERVICE`, `ENOMETHOD` | 1001, 1002 | the server has no such service or method | no |
| `ERPCAUTH` | 1004 | the server rejected the credential (`auth`) | no |
| `ERPCTIMEDOUT` | 1008 | the call's deadline (`timeout_ms`) passed | never |
| `EBACKUPREQUEST` | 1007 | the backup timer fired with no retry left (brpc's behaviour, kept) | never |
| `ECANCELED` | 125 | the task awaiting the call was cancelled | never |
| `ELIMIT` | 2004 | the server is at `max_concurrency` | yes |
| `ELOGOFF` | 2003 | the server is stopping | yes |
| `EOVERCROWDED` | 1011 | too many bytes wait to be written on the connection (`max_unwritten_bytes`) | yes |
| `EFAILEDSOCKET`, `EEOF` | 1009, 1014 | the connection broke or was closed with the call in flight | yes |
| `ECONNREFUSED`, `ETIMEDOUT` | 111, 110 | the connect was refused or timed out (`connect_timeout_ms`) | yes |
| `EHOSTDOWN` | 112 | the server is marked down (health check running), or the channel is closed | yes |
| `EHOSTUNREACH` | 113 | the host name does not resolve | no |
| `ENODATA` | 61 | the naming service lists no server (the text names its last fault, when it failed) | yes |
| `EREJECT` | 1018 | rejected by the load balancer's cluster recovery (rr, random with `min_working_instances`) | never |
| `EINVAL` | 22 | a Channel was called from a second event loop while the first still runs in another thread; a consistent-hashing load balancer got no `request_code` (or one over 32 bits) | no |

A handler may also raise codes of its own (any int but 0, clear of the numbers above);
`describe()` calls them "Unknown error N" unless the text says more.
"""

from __future__ import annotations

# errno values as brpc uses them (Linux numbering, never the host's).
EPERM = 1
ENOENT = 2
EBADF = 9
EAGAIN = 11
ENOMEM = 12
EINVAL = 22
EPIPE = 32
ENODATA = 61
EPROTO = 71
ENETUNREACH = 101
ECONNRESET = 104
ETIMEDOUT = 110
ECONNREFUSED = 111
EHOSTDOWN = 112
EHOSTUNREACH = 113
ECANCELED = 125

# brpc's own codes.
ENOSERVICE = 1001
ENOMETHOD = 1002
EREQUEST = 1003
ERPCAUTH = 1004
ETOOMANYFAILS = 1005
EPCHANFINISH = 1006
EBACKUPREQUEST = 1007
ERPCTIMEDOUT = 1008
EFAILEDSOCKET = 1009
EHTTP = 1010
EOVERCROWDED = 1011
ERTMPPUBLISHABLE = 1012
ERTMPCREATESTREAM = 1013
EEOF = 1014
EUNUSED = 1015
ESSL = 1016
EH2RUNOUTSTREAMS = 1017
EREJECT = 1018
EPROGREADTIMEOUT = 1019
EINTERNAL = 2001
ERESPONSE = 2002
ELOGOFF = 2003
ELIMIT = 2004
ECLOSE = 2005
EITP = 2006
ESHUTDOWNWRITE = 2007
ERDMA = 3001
ERDMAMEM = 3002

# berror() texts registered by brpc.
DESCRIPTIONS: dict[int, str] = {
    ENOSERVICE: "No such service",
    ENOMETHOD: "No such method",
    EREQUEST: "Bad request",
    ERPCAUTH: "Authentication failed",
    ETOOMANYFAILS: "Too many sub channels failed",
    EPCHANFINISH: "ParallelChannel finished",
    EBACKUPREQUEST: "Sending backup request",
    ERPCTIMEDOUT: "RPC call is timed out",
    EFAILEDSOCKET: "Broken socket",
    EHTTP: "Bad http call",
    EOVERCROWDED: "The server is overcrowded",
    EEOF: "Got EOF",
    EUNUSED: "The socket was not needed",
    ESSL: "SSL related operation failed",
    EH2RUNOUTSTREAMS: "The H2 socket was run out of streams",
    EREJECT: "The Request is rejected",  # errno.proto's comment: brpc registers no text
    EPROGREADTIMEOUT: "Progressive read timed out",
    EINTERNAL: "General internal error",
    ERESPONSE: "Bad response",
    ELOGOFF: "Server is stopping",
    ELIMIT: "Reached server's max_concurrency",
    ECLOSE: "Close socket initiatively",
    EITP: "Bad Itp response",
    ESHUTDOWNWRITE: "Shutdown write of socket",
    ERDMA: "RDMA verbs error",
    ERDMAMEM: "Memory not registered for RDMA",
    EPERM: "Operation not permitted",
    ENOENT: "No such file or directory",
    EBADF: "Bad file descriptor",
    EAGAIN: "Resource temporarily unavailable",
    ENOMEM: "Cannot allocate memory",
    EINVAL: "Invalid argument",
    EPIPE: "Broken pipe",
    ENODATA: "No data available",
    EPROTO: "Protocol error",
    ENETUNREACH: "Network is unreachable",
    ECONNRESET: "Connection reset by peer",
    ETIMEDOUT: "Connection timed out",
    ECONNREFUSED: "Connection refused",
    EHOSTDOWN: "Host is down",
    EHOSTUNREACH: "No route to host",
    ECANCELED: "Operation canceled",
}

# What brpc's default RpcRetryPolicy retries (brpc's src/brpc/retry_policy.cpp).
DEFAULT_RETRYABLE = frozenset({
    EFAILEDSOCKET, EEOF, EHOSTDOWN, ELOGOFF, ETIMEDOUT, ELIMIT, ENOENT, EPIPE,
    ECONNREFUSED, ECONNRESET, ENODATA, EOVERCROWDED, EH2RUNOUTSTREAMS,
})


def describe(code: int) -> str:
    """brpc's description of `code`, or a generic one for user codes."""
    return DESCRIPTIONS.get(code, f"Unknown error {code}")


class RpcError(Exception):
    """A call failed with brpc error `code` and human-readable `text`.

    What a failed call raises (the same code and text are in its `Controller`), and what a
    handler raises to fail its call: the server sends `code` and `text` to the caller, who
    gets an RpcError with that code. For invalid input raise `errors.EREQUEST` (1003), which
    no caller retries; any other exception in a handler reaches the caller as EINTERNAL.

    >>> raise aiobrpc.RpcError(aiobrpc.errors.EREQUEST, "key must not be empty")  # doctest: +SKIP

    `str(e)` is brpc's form, `[E<code>]<text>`.

    Attributes:
        code (int): The brpc error code, one of this module's constants or a user code.
        text (str): What happened; a failure at the server starts with its "[ip:port]".
    """

    def __init__(self, code: int, text: str = "") -> None:
        if not isinstance(code, int) or isinstance(code, bool):
            raise TypeError(f"RpcError code must be an int, got {type(code).__name__}")
        self.code = code
        self.text = text or describe(code)
        super().__init__(code, self.text)

    def __str__(self) -> str:
        return f"[E{self.code}]{self.text}"


class ProtocolError(Exception):
    """Base of the codec errors. `code` is the brpc code a reply or a failed call carries."""

    def __init__(self, message: str, code: int = EREQUEST) -> None:
        super().__init__(message)
        self.code = code


class RemoteProtocolError(ProtocolError):
    """The peer sent something we cannot accept.

    `fatal` is True when framing can no longer be trusted and the connection must close;
    False when only this message is bad (the server answers it with `code`, the client fails
    that call with it).
    """

    def __init__(self, message: str, code: int = EREQUEST, fatal: bool = True) -> None:
        super().__init__(message, code)
        self.fatal = fatal


class LocalProtocolError(ProtocolError, ValueError):
    """Our caller asked for something the protocol cannot express."""
