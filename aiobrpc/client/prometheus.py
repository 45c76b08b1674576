"""A channel's figures in Prometheus' text format, and a prometheus_client collector of them.

>>> from prometheus_client import REGISTRY  # doctest: +SKIP
>>> REGISTRY.register(ChannelCollector(channel, name="echo"))  # doctest: +SKIP

Names follow the server's (`rpc_server_<port>_...`, aiobrpc/server/builtin.py), with the
channel's `name` in place of the port:

* `rpc_client_<name>_<service_method>_latency`: a summary of each method's latencies in
  microseconds (quantiles 0.5 .. 0.9999 over the last 10 s, 1 = the largest), `<service_method>`
  in brpc's underscored form (`example.EchoService/Echo` -> `example_echo_service_echo`);
  past `MAX_METHODS` methods, the others' calls are `rpc_client_<name>_other_...`;
* `rpc_client_<name>_<service_method>_{count, qps, error, eps, retries, backups}`: gauges;
* `rpc_client_<name>_<counter>`: the channel's `ClientStats` (timeouts, retries,
  backup_requests, connections_made ...), and `pending_calls`, `connection_count`.

prometheus_client is not a dependency of aiobrpc: install it to use the collector.
"""

from __future__ import annotations

from ..metrics import prometheus_lines, underscored


def channel_name(channel) -> str:
    """The default `name` of a channel: its address underscored ("127.0.0.1:8000" -> "127_0_0_1_8000")."""
    return underscored(channel.address)


def prometheus_text(channel, name: str | None = None) -> str:
    """`channel`'s figures, each method's latencies as a summary, everything else as gauges."""
    prefix = f"rpc_client_{underscored(name) if name is not None else channel_name(channel)}"
    out: list[str] = []
    for method, figs in channel.status().items():
        out += prometheus_lines(f"{prefix}_{underscored(method)}", figs)
    counters = channel.stats.as_dict()
    counters["pending_calls"] = channel.pending_calls()
    counters["connection_count"] = channel.connection_count()
    for k, v in counters.items():
        out += [f"# HELP {prefix}_{k}", f"# TYPE {prefix}_{k} gauge", f"{prefix}_{k} {v}"]
    return "\n".join(out) + "\n"


class ChannelCollector:
    """Collects `channel`'s figures on every scrape, under `rpc_client_<name>_` (default: the
    channel's address underscored). Register one per channel, each with its own name."""

    def __init__(self, channel, name: str | None = None) -> None:
        self.channel = channel
        self.name = name

    def collect(self):
        from prometheus_client.parser import text_string_to_metric_families
        yield from text_string_to_metric_families(prometheus_text(self.channel, self.name))
