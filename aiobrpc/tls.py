"""TLS settings of servers and channels, made into `ssl.SSLContext`s.

A server speaks TLS on its ordinary port: a connection whose first bytes are a TLS handshake
record is wrapped (server/tls_layer.py) and its protocol is detected again inside. A channel
with TLS verifies the server's certificate and name by default and never falls back to
plaintext: a failed handshake fails the call with ESSL.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

VERIFY_MODES = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


@dataclass
class ServerTlsOptions:
    """A server's TLS (brpc's ServerSSLOptions).

    Attributes:
        cert_file: PEM file of the server's certificate chain (may hold the key too).
        key_file: PEM file of its private key; None: in `cert_file`.
        password: The key's password, if it is encrypted.
        ca_file: PEM file of the CAs that client certificates must chain to (mutual TLS).
        verify_client: "none" (no client certificate asked), "optional" (verified when sent),
            or "required" (mutual TLS: a client without a valid certificate fails the handshake).
        ciphers: An OpenSSL cipher list for TLS 1.2; None: Python's defaults.
        minimum_version: The oldest TLS version accepted.
    """

    cert_file: str
    key_file: str | None = None
    password: str | None = None
    ca_file: str | None = None
    verify_client: str = "none"
    ciphers: str | None = None
    minimum_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2

    def __post_init__(self) -> None:
        if self.verify_client not in VERIFY_MODES:
            raise ValueError(f"verify_client must be one of {sorted(VERIFY_MODES)}, got {self.verify_client!r}")
        if self.verify_client != "none" and not self.ca_file:
            raise ValueError(f"verify_client={self.verify_client!r} needs ca_file: the CAs client certificates "
                             "must chain to")

    def context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = self.minimum_version
        ctx.load_cert_chain(self.cert_file, self.key_file, self.password)
        if self.ca_file:
            ctx.load_verify_locations(self.ca_file)
        ctx.verify_mode = VERIFY_MODES[self.verify_client]
        if self.ciphers:
            ctx.set_ciphers(self.ciphers)
        return ctx


@dataclass
class ClientTlsOptions:
    """A channel's TLS (brpc's ChannelSSLOptions).

    Attributes:
        ca_file: PEM file of the CAs the server's certificate must chain to; None: the
            system's trusted CAs.
        cert_file, key_file, password: The client's own certificate, for servers that require
            one (mutual TLS); None: none sent.
        verify: Verify the server's certificate (and its name, see `server_hostname`). Turning
            it off accepts any server: for tests only.
        server_hostname: The name the certificate must carry, also sent as SNI; None: the host
            of the address called.
        ciphers, minimum_version: As ServerTlsOptions.
    """

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    password: str | None = None
    verify: bool = True
    server_hostname: str | None = None
    ciphers: str | None = None
    minimum_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2

    def __post_init__(self) -> None:
        if self.key_file and not self.cert_file:
            raise ValueError("key_file without cert_file: the client certificate is missing")

    def context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca_file)
        ctx.minimum_version = self.minimum_version
        if not self.verify:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if self.cert_file:
            ctx.load_cert_chain(self.cert_file, self.key_file, self.password)
        if self.ciphers:
            ctx.set_ciphers(self.ciphers)
        return ctx


def server_context(setting, name: str = "ssl") -> ssl.SSLContext | None:
    """ServerOptions.ssl as a context: None, an SSLContext (used as is) or ServerTlsOptions."""
    if setting is None:
        return None
    if isinstance(setting, ssl.SSLContext):
        return setting
    if isinstance(setting, ServerTlsOptions):
        return setting.context()
    raise TypeError(f"{name} must be None, a ServerTlsOptions or an ssl.SSLContext, got {type(setting).__name__}")


def client_context(setting, name: str = "ssl") -> ssl.SSLContext | None:
    """ChannelOptions.ssl as a context: None/False (plaintext), True (the system's CAs, names
    verified), ClientTlsOptions, or an SSLContext (used as is)."""
    if setting is None or setting is False:
        return None
    if setting is True:
        return ClientTlsOptions().context()
    if isinstance(setting, ssl.SSLContext):
        return setting
    if isinstance(setting, ClientTlsOptions):
        return setting.context()
    raise TypeError(f"{name} must be None, True, a ClientTlsOptions or an ssl.SSLContext, "
                    f"got {type(setting).__name__}")


def client_context_of(options) -> ssl.SSLContext | None:
    """The context of a ChannelOptions' `ssl`, made once per options object and setting (its
    files are read at the first connect, not at every one)."""
    setting = options.ssl
    cached = options.__dict__.get("_ssl_context")
    if cached is not None and cached[0] is setting:
        return cached[1]
    ctx = client_context(setting)
    options.__dict__["_ssl_context"] = (setting, ctx)
    return ctx
