"""Naming services: where a cluster channel gets its servers from (brpc's docs/en/client.md).

`create_naming_service("list://10.0.0.1:80,10.0.0.2:80")` picks the implementation by URL
scheme: list://, dlist://, file://, http://, https://, dns:// and etcd:// (docs/naming.md);
`register_naming_service` adds schemes.

>>> create_naming_service("list://127.0.0.1:8000").servers
(ServerNode(host='127.0.0.1', port=8000, tag=''),)
>>> is_naming_url("list://a:1"), is_naming_url("127.0.0.1:8000")
(True, False)
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

from .base import NamingService, ServerNode, parse_entry, split_entry
from .dlist import DomainListNamingService
from .dns import DnsNamingService
from .etcd import EtcdNamingService
from .file import FileNamingService
from .list import ListNamingService  # note: binds `list` in this module to the submodule
from .periodic import PeriodicNamingService

__all__ = [
    "DnsNamingService", "DomainListNamingService", "EtcdNamingService", "FileNamingService",
    "ListNamingService", "NamingService", "PeriodicNamingService", "ServerNode",
    "create_naming_service", "is_naming_url", "parse_entry", "register_naming_service",
    "split_entry",
]

_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")

# scheme -> factory taking the URL's part after "scheme://".
_REGISTRY: dict[str, Callable[[str], NamingService]] = {}


def is_naming_url(text: str) -> bool:
    """True for `scheme://...` (a cluster channel), False for `host:port` (single server)."""
    return _URL.match(text) is not None


def register_naming_service(scheme: str, factory: Callable[[str], NamingService]) -> None:
    """Make `scheme://rest` URLs create `factory(rest)`; replaces an earlier registration."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        raise ValueError(f"bad naming service scheme {scheme!r}")
    _REGISTRY[scheme] = factory


def create_naming_service(url: str) -> NamingService:
    """The naming service for `url`; ValueError for a malformed URL or an unknown scheme."""
    match = _URL.match(url)
    if match is None:
        raise ValueError(f"naming service URL must look like scheme://..., got {url!r}")
    scheme = match.group(1)
    factory = _REGISTRY.get(scheme)
    if factory is None:
        known = ", ".join(f"{s}://" for s in sorted(_REGISTRY))
        raise ValueError(f"unknown naming service {scheme}:// in {url!r}; known: {known}")
    return factory(url[match.end():])


register_naming_service("list", ListNamingService)
register_naming_service("dlist", DomainListNamingService)
register_naming_service("file", FileNamingService)
register_naming_service("http", functools.partial(DnsNamingService, scheme="http"))
register_naming_service("https", functools.partial(DnsNamingService, scheme="https"))
register_naming_service("dns", functools.partial(DnsNamingService, scheme="dns"))
register_naming_service("etcd", EtcdNamingService)
