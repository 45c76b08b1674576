"""The builtin pages on the server's port, each fetched and its content checked."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
from html.parser import HTMLParser

import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

import aiobrpc
from aiobrpc._proto import interop_pb2
from tests.e2e.test_http import fetch
from tests.helpers.interop_server import SERVICE, InteropEcho
from tests.helpers.waiting import wait_until

SVC = "interop.EchoService"
CURL = {"User-Agent": "curl/8.5.0"}
BROWSER = {"User-Agent": "Mozilla/5.0"}


@pytest_asyncio.fixture
async def server():
    srv = aiobrpc.Server(aiobrpc.ServerOptions(max_concurrency=50, version="interop-probe 1.0"))
    srv.add_service(InteropEcho())
    await srv.start("127.0.0.1:0")
    ch = aiobrpc.Channel(srv.address, aiobrpc.ChannelOptions(max_retry=0))
    stub = aiobrpc.Stub(ch, SERVICE)
    for i in range(20):  # traffic to report: 17 fine, 3 failed
        try:
            await stub.Echo(interop_pb2.EchoRequest(message="m", **({"fail_code": 1234} if i % 6 == 3 else {})))
        except aiobrpc.RpcError:
            pass
    await ch.close()
    yield srv
    await srv.stop()
    await srv.join(timeout=2)


async def get(srv, path: str, headers: dict | None = None):
    def go():
        c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=5)
        try:
            c.request("GET", path, headers=headers if headers is not None else CURL)
            r = c.getresponse()
            return r.status, r.getheader("Content-Type"), r.read().decode()
        finally:
            c.close()
    return await asyncio.to_thread(go)


async def test_health_and_version(server):
    assert await get(server, "/health") == (200, "text/plain", "OK")
    assert await get(server, "/version") == (200, "text/plain", "interop-probe 1.0")


async def test_the_default_version_names_the_servicers():
    async with aiobrpc.Server() as srv:
        srv.add_service(InteropEcho())
        await srv.start("127.0.0.1:0")
        assert (await get(srv, "/version"))[2] == "InteropEcho"


async def test_status_as_text_json_and_html(server):
    status, ctype, text = await get(server, "/status")
    assert status == 200 and ctype == "text/plain"
    assert "version: interop-probe 1.0" in text and "max_concurrency: 50" in text
    assert f"[{SVC}]" in text and "  count: 20" in text and "  error: 3" in text

    status, ctype, body = await get(server, "/status?format=json")
    data = json.loads(body)
    assert ctype == "application/json" and data["max_concurrency"] == 50
    echo = data["services"][SVC]["Echo"]
    assert echo["count"] == 20 and echo["error"] == 3 and echo["concurrency"] == 0
    assert 0 <= echo["latency_50"] <= echo["latency_99"] <= echo["max_latency"] or echo["max_latency"] == 0
    assert data["services"][SVC]["StartStream"]["count"] == 0

    status, ctype, page = await get(server, "/status", BROWSER)
    assert ctype == "text/html"
    tables = _tables(page)
    method_rows = {row[0]: row for row in tables[SVC][1:]}
    header = tables[SVC][0]
    assert header[:4] == ["method", "count", "qps", "error"]
    assert method_rows["Echo"][1:4:2] == ["20", "3"]


async def test_vars_filtered_by_wildcards(server):
    port = server.port
    status, _, text = await get(server, f"/vars/rpc_server_{port}_interop_echo_service_echo_*")
    lines = dict(line.split(" : ") for line in text.splitlines())
    assert lines[f"rpc_server_{port}_interop_echo_service_echo_count"] == "20"
    assert lines[f"rpc_server_{port}_interop_echo_service_echo_error"] == "3"
    assert all(name.startswith(f"rpc_server_{port}_interop_echo_service_echo_") for name in lines)
    status, _, text = await get(server, "/vars/process_*;*_connection_count?format=json")
    data = json.loads(text)
    assert "process_uptime" in data and f"rpc_server_{port}_connection_count" in data
    status, _, text = await get(server, "/vars")
    assert "aiobrpc_version : " in text


async def test_brpc_metrics_parse_as_prometheus_text(server):
    status, ctype, text = await get(server, "/brpc_metrics")
    assert status == 200 and ctype.startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(text)}
    port = server.port
    summary = families[f"rpc_server_{port}_interop_echo_service_echo_latency"]
    assert summary.type == "summary"
    samples = {(s.name, s.labels.get("quantile")): s.value for s in summary.samples}
    assert samples[(f"rpc_server_{port}_interop_echo_service_echo_latency_count", None)] == 20
    assert {q for _, q in samples if q} == {"0.5", "0.9", "0.99", "0.999", "0.9999", "1"}
    count = families[f"rpc_server_{port}_interop_echo_service_echo_count"]
    assert count.type == "gauge" and count.samples[0].value == 20
    assert families["process_memory_resident"].samples[0].value > 0


async def test_flags_protobufs_connections_and_index(server):
    _, _, text = await get(server, "/flags")
    assert "max_concurrency : 50" in text and "version : 'interop-probe 1.0'" in text
    _, _, text = await get(server, "/flags/max_*?format=json")
    assert json.loads(text)["max_body_size"] == 64 << 20
    _, _, text = await get(server, "/protobufs")
    assert text.splitlines() == [SVC, "interop.EchoRequest", "interop.EchoResponse"]
    _, _, text = await get(server, f"/protobufs/{SVC}")
    assert "rpc StartStream (EchoRequest) returns (EchoResponse);" in text
    _, _, text = await get(server, "/protobufs/interop.EchoRequest")
    assert 'name: "message"' in text
    assert (await get(server, "/protobufs/no.Such"))[0] == 404
    _, _, text = await get(server, "/connections?format=json")
    rows = json.loads(text)
    assert [r["protocol"] for r in rows] == ["http"]  # the one asking
    _, _, text = await get(server, "/")
    assert "status: /status" in text and f"{SVC}/Echo: /{SVC}/Echo" in text
    _, ctype, page = await get(server, "/index", BROWSER)
    assert ctype == "text/html" and 'href="/brpc_metrics"' in page


async def test_builtin_pages_can_be_turned_off():
    async with aiobrpc.Server(aiobrpc.ServerOptions(has_builtin_services=False)) as srv:
        srv.add_service(InteropEcho())
        await srv.start("127.0.0.1:0")
        for path in ("/status", "/vars", "/health", "/"):
            assert (await get(srv, path))[0] == 404


@pytest.mark.parametrize("ua,ctype", [(None, "text/plain"), ("curl/8", "text/plain"), ("Mozilla/5.0", "text/html")])
async def test_text_for_consoles_html_for_browsers(server, ua, ctype):
    headers = {} if ua is None else {"User-Agent": ua}
    assert (await get(server, "/vars", headers))[1] == ctype
    if ua and "Mozilla" in ua:
        assert (await get(server, "/vars?console=1", headers))[1] == "text/plain"


def _tables(page: str) -> dict:
    """{data-service: rows of cells} of the page's service tables."""

    class P(HTMLParser):
        def __init__(self):
            super().__init__()
            self.tables, self.cur, self.row, self.cell = {}, None, None, None

        def handle_starttag(self, tag, attrs):
            attrs = dict(attrs)
            if tag == "table" and "data-service" in attrs:
                self.cur = self.tables.setdefault(attrs["data-service"], [])
            elif tag == "tr" and self.cur is not None:
                self.row = []
                self.cur.append(self.row)
            elif tag in ("td", "th") and self.row is not None:
                self.cell = ""

        def handle_endtag(self, tag):
            if tag in ("td", "th") and self.cell is not None:
                self.row.append(self.cell)
                self.cell = None
            elif tag == "table":
                self.cur = None

        def handle_data(self, data):
            if self.cell is not None:
                self.cell += data

    p = P()
    p.feed(page)
    return p.tables


async def test_without_method_status_calls_are_served_and_not_counted():
    async with aiobrpc.Server(aiobrpc.ServerOptions(method_status=False)) as srv:
        srv.add_service(InteropEcho())
        await srv.start("127.0.0.1:0")
        ch = aiobrpc.Channel(srv.address)
        resp = await aiobrpc.Stub(ch, SERVICE).Echo(interop_pb2.EchoRequest(message="m"))
        await ch.close()
        assert resp.message == "m"
        _, _, body = await get(srv, "/status?format=json")
        assert json.loads(body)["services"][SVC]["Echo"]["count"] == 0


async def test_an_internal_port_keeps_the_pages_off_the_public_one():
    async with aiobrpc.Server(aiobrpc.ServerOptions(internal_port=0)) as srv:
        srv.add_service(InteropEcho())
        await srv.start("127.0.0.1:0")
        assert srv.internal_port not in (0, srv.port)

        class Internal:
            port = srv.internal_port

        status, ctype, body = await get(srv, "/status")
        assert (status, ctype) == (403, "text/plain") and "[E1]/status is served on the internal port only" in body
        assert (await get(Internal, "/health")) == (200, "text/plain", "OK")
        _, _, body = await get(Internal, "/connections?format=json")
        assert [r["internal"] for r in json.loads(body)] == [True]
        for port in (srv.port, srv.internal_port):  # the methods are on both
            ch = aiobrpc.Channel(f"127.0.0.1:{port}")
            assert (await aiobrpc.Stub(ch, SERVICE).Echo(interop_pb2.EchoRequest(message="m"))).message == "m"
            await ch.close()
    assert srv._internal_listener is None and not srv.connections


def test_internal_port_is_checked():
    with pytest.raises(ValueError, match="internal_port must be -1"):
        aiobrpc.ServerOptions(internal_port=70000)


async def test_a_prometheus_client_registry_collects_the_server(server):
    from prometheus_client import CollectorRegistry, generate_latest

    from aiobrpc.server.prometheus import ServerCollector
    registry = CollectorRegistry()
    registry.register(ServerCollector(server))
    text = generate_latest(registry).decode()
    port = server.port
    assert f"rpc_server_{port}_interop_echo_service_echo_count 20.0" in text
    assert f'rpc_server_{port}_interop_echo_service_echo_latency{{quantile="0.99"}}' in text


# -- plots: each variable's last 60 seconds and 60 minutes (series.py, plot.py) ------------------
def sample(srv, n: int) -> None:
    """Take `n` samples now, as the housekeeper does once a second."""
    from aiobrpc.server import builtin
    for _ in range(n):
        srv.series.sample(builtin.variables(srv))


async def test_a_variable_page_plots_its_last_60_seconds_and_60_minutes(server):
    sample(server, 61)  # a minute of samples: one per-minute point
    var = f"rpc_server_{server.port}_interop_echo_service_echo_count"
    status, ctype, page = await get(server, f"/vars/{var}", BROWSER)
    assert status == 200 and ctype == "text/html"
    assert page.count("<svg") == 2 and "last 60 seconds" in page and "last 60 minutes" in page
    assert page.count("<polyline") == 2 and "now: 20" in page  # 20 calls were made
    _, _, listing = await get(server, "/vars", BROWSER)
    assert f'href="/vars/{var}"' in listing  # a click on a name opens its plots
    _, _, text = await get(server, f"/vars/{var}?format=json&series=1", CURL)
    got = json.loads(text)
    assert got["name"] == var and got["seconds"] == [20.0] * 60 and got["minutes"] == [20.0]


async def test_a_plot_before_any_sample_says_so(server):
    var = f"rpc_server_{server.port}_requests"
    _, _, page = await get(server, f"/vars/{var}", BROWSER)
    assert page.count("no samples yet") == 2 or page.count("<polyline") == 2  # the housekeeper may have sampled


async def test_status_plots_each_methods_latency(server):
    sample(server, 3)
    _, _, page = await get(server, "/status", BROWSER)
    assert "Echo latency (us)" in page and page.count("<svg") >= 2 * len(SERVICE.methods)


async def test_the_server_samples_its_variables_every_second_by_itself(server):
    for _ in range(100):  # the housekeeper's first tick comes a second after start
        if server.series.samples:
            break
        await asyncio.sleep(0.1)
    await wait_until(lambda: server.series.samples >= 1)
    assert server.series.samples >= 1
    assert server.series.get(f"rpc_server_{server.port}_requests") is not None


def test_the_series_table_is_bounded():
    from aiobrpc.server.series import MINUTES, SECONDS, SeriesTable
    table = SeriesTable(max_series=3)
    for i in range(200):
        table.sample([(f"v{j}", float(i)) for j in range(10)] + [("text", "x"), ("flag", True), ("nan", float("nan"))])
    assert sorted(table.series) == ["v0", "v1", "v2"]  # past max_series, names are not tracked
    s = table.get("v0")
    assert len(s.seconds) == SECONDS and list(s.seconds)[-1] == 199.0
    assert len(s.minutes) == 3 <= MINUTES and list(s.minutes)[0] == sum(range(60)) / 60
    assert table.sample_if_due(100.0, []) and not table.sample_if_due(100.5, []) and table.sample_if_due(101.0, [])


async def test_the_pages_escape_names_and_never_plot_a_peers_pattern(server):
    _, _, page = await get(server, "/vars/%3Cscript%3E*", BROWSER)
    assert "<script>" not in page
    _, _, page = await get(server, "/vars/rpc_server_*_requests", BROWSER)
    assert "<svg" not in page  # a pattern lists; only a variable's own name plots


async def test_every_link_of_the_index_opens_on_a_default_server(server):
    _, _, page = await get(server, "/", BROWSER)
    links = re.findall(r'<a href="([^"]+)"', page)
    assert "/rpcz" in links and "/favicon.ico" not in links
    for link in links:
        status, _, body = await get(server, link, BROWSER)
        assert status == 200, (link, status, body[:200])
    status, headers, icon = await fetch(server, "GET", "/favicon.ico", headers=BROWSER)
    ctype = dict(headers).get("Content-Type")
    assert (status, ctype) == (200, "image/png") and icon.startswith(b"\x89PNG")  # a browser asks for it
