"""list:// naming service, server entries and the naming registry (brpc's docs/en/client.md)."""

from __future__ import annotations

import pytest

from aiobrpc.client.naming import (
    ListNamingService, NamingService, ServerNode, create_naming_service, is_naming_url,
    parse_entry, register_naming_service, split_entry,
)


def nodes(url: str) -> list[str]:
    return [str(s) for s in ListNamingService(url).servers]


def test_entries_with_tags_blanks_and_empty_entries():
    url = "list:// 10.0.0.1:80 ,,10.0.0.2:81   canary tag ,  ,localhost:82 b"
    assert ListNamingService(url).servers == (
        ServerNode("10.0.0.1", 80), ServerNode("10.0.0.2", 81, "canary tag"),
        ServerNode("localhost", 82, "b"),
    )


def test_duplicates_keep_the_first_and_tags_make_servers_distinct():
    assert nodes("list://b:2,a:1,b:2,a:1 t,a:1,a:1 t") == ["b:2", "a:1", "a:1(tag=t)"]


def test_ipv6_entries():
    servers = ListNamingService("list://[::1]:8000,[fe80::1]:9 x").servers
    assert servers == (ServerNode("::1", 8000), ServerNode("fe80::1", 9, "x"))
    assert [s.address for s in servers] == ["[::1]:8000", "[fe80::1]:9"]


def test_hostnames_are_kept_as_given():
    assert ListNamingService("list://Some-Host.example:80").servers[0].host == \
        "Some-Host.example"


def test_comments_as_in_brpc():
    assert split_entry("# off") is None
    assert nodes("list://# disabled 1.1.1.1:1,2.2.2.2:2 tag # note") == ["2.2.2.2:2(tag=tag)"]


def test_the_scheme_is_optional_and_other_schemes_are_refused():
    assert nodes("1.1.1.1:1") == ["1.1.1.1:1"]
    assert ListNamingService("list://").servers == ()
    with pytest.raises(ValueError, match="list://"):
        ListNamingService("file://x")


@pytest.mark.parametrize("entry", [
    "10.0.0.1", "10.0.0.1:", "10.0.0.1:0", "10.0.0.1:65536", "10.0.0.1:8o", "10.0.0.1:+80",
    "10.0.0.1:-1", "10.0.0.300:80", ":80", "::1:80", "[::1]80", "[::1", "[zz::1]:80",
    "bad/host:80", "ex ample:80x", "10.0.0.1:٣",
])
def test_bad_entries_raise_value_error_naming_the_entry(entry):
    with pytest.raises(ValueError) as info:
        ListNamingService(f"list://1.1.1.1:1,{entry},2.2.2.2:2")
    assert repr(entry) in str(info.value)


def test_parse_entry():
    assert parse_entry("  h:1   a  b  ") == ServerNode("h", 1, "a  b")
    with pytest.raises(ValueError, match="empty server entry"):
        parse_entry("  ")


def test_server_node_identity_and_validation():
    assert ServerNode("h", 1, "t") == ServerNode("h", 1, "t")
    assert len({ServerNode("h", 1), ServerNode("h", 1), ServerNode("h", 1, "t")}) == 2
    assert min(ServerNode("b", 1), ServerNode("a", 2)).host == "a"
    for port in (0, 65536, "80", True):
        with pytest.raises(ValueError, match="port"):
            ServerNode("h", port)
    with pytest.raises(ValueError, match="host"):
        ServerNode("", 1)


async def test_watch_yields_the_list_once():
    ns = ListNamingService("list://1.1.1.1:1,2.2.2.2:2")
    lists = [servers async for servers in ns.watch()]
    assert lists == [[ServerNode("1.1.1.1", 1), ServerNode("2.2.2.2", 2)]]
    await ns.close()


def test_registry():
    assert isinstance(create_naming_service("list://1.1.1.1:1"), ListNamingService)
    with pytest.raises(ValueError, match=r"unknown naming service nope://.*known: .*list://"):
        create_naming_service("nope://x")
    with pytest.raises(ValueError, match="scheme://"):
        create_naming_service("1.1.1.1:1")

    class Fixed(NamingService):
        def __init__(self, rest: str) -> None:
            self.rest = rest

        async def watch(self):
            yield []

    register_naming_service("fixedtest", Fixed)
    assert create_naming_service("fixedtest://abc").rest == "abc"
    with pytest.raises(ValueError, match="scheme"):
        register_naming_service("1bad", Fixed)


def test_is_naming_url():
    assert is_naming_url("list://a:1") and is_naming_url("http://h") and is_naming_url("x+y://")
    assert not is_naming_url("127.0.0.1:80") and not is_naming_url("[::1]:80")
    assert not is_naming_url("list:/a")
