"""Prometheus metrics, read from the dashboard's current state at scrape time.

Each app gets its own :class:`CollectorRegistry` (never the process-wide default), so two
dashboards in one process, or a test, do not collide. Per-server series are labelled by model,
peer id and public name; a series disappears when the dashboard forgets the server.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from protocol.records import ServerState
from swarm.dashboard.state import State

PREFIX = "specswarm"


class StateCollector(Collector):
    def __init__(self, get_state: Callable[[], State]):
        self.get_state = get_state

    def collect(self) -> Iterator[Metric]:
        state = self.get_state()
        yield from _model_metrics(state)
        yield from _block_metrics(state)
        yield from _server_metrics(state)
        yield from _dashboard_metrics(state)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=labels)


def _model_metrics(state: State) -> Iterator[Metric]:
    healthy = _gauge("model_healthy", "1 if every block has an online server", ["model"])
    blocks = _gauge("model_blocks", "Number of blocks (transformer layers) of the model", ["model"])
    missing = _gauge("model_missing_blocks", "Blocks no online server holds", ["model"])
    flow = _gauge("model_max_flow_tokens_per_second", "Max-flow of the online servers through all blocks", ["model"])
    servers = _gauge("model_servers", "Servers listed, by state", ["model", "state"])
    for name, model in state.models.items():
        healthy.add_metric([name], float(model.healthy))
        blocks.add_metric([name], float(model.num_blocks or 0))
        missing.add_metric([name], float(len(model.missing_blocks)))
        flow.add_metric([name], model.max_flow)
        for server_state in ServerState:
            count = sum(entry.state == server_state for entry in model.servers.values())
            servers.add_metric([name, server_state.value], float(count))
    yield from (healthy, blocks, missing, flow, servers)


def _block_metrics(state: State) -> Iterator[Metric]:
    count = _gauge("block_servers", "Online servers holding the block", ["model", "block"])
    throughput = _gauge("block_throughput_tokens_per_second", "Total throughput of those servers", ["model", "block"])
    for name, model in state.models.items():
        for block, cover in enumerate(model.coverage):
            count.add_metric([name, str(block)], float(cover.servers))
            throughput.add_metric([name, str(block)], cover.throughput)
    yield from (count, throughput)


def _server_metrics(state: State) -> Iterator[Metric]:
    labels = ["model", "peer_id", "public_name"]
    up = _gauge("server_online", "1 if the server's state is online", labels)
    throughput = _gauge("server_throughput_tokens_per_second", "Throughput the server announced", labels)
    free_cache = _gauge("server_free_cache_tokens", "KV cache tokens the server has left", labels)
    rtt = _gauge("server_probe_rtt_seconds", "Round-trip time of the dashboard's last ping", labels)
    laps = CounterMetricFamily(f"{PREFIX}_server_laps_served", "Runs computed since the server started", labels=labels)
    accepted = CounterMetricFamily(
        f"{PREFIX}_server_accepted_tokens", "Tokens committed by the tail's results", labels=labels
    )
    cancelled = CounterMetricFamily(f"{PREFIX}_server_cancelled_runs", "Runs cancelled on the server", labels=labels)
    disputed = _gauge(
        "server_disputed_by_clients", "Clients reporting the server lying in a spot-check (claims)", labels
    )
    for name, model in state.models.items():
        for peer_id, entry in model.servers.items():
            values = [name, peer_id, entry.info.public_name or ""]
            up.add_metric(values, float(entry.state == ServerState.ONLINE))
            throughput.add_metric(values, entry.info.throughput)
            free_cache.add_metric(values, float(entry.info.free_cache_tokens))
            if entry.rtt is not None:
                rtt.add_metric(values, entry.rtt)
            laps.add_metric(values, float(entry.info.laps_served))
            accepted.add_metric(values, float(entry.info.accepted_tokens))
            cancelled.add_metric(values, float(entry.info.cancelled_runs))
            disputed.add_metric(values, float(model.disputes.get(peer_id, 0)))
    yield from (up, throughput, free_cache, rtt, laps, accepted, cancelled, disputed)


def _dashboard_metrics(state: State) -> Iterator[Metric]:
    updated = _gauge("dashboard_last_update_timestamp_seconds", "Unix time of the last successful poll", [])
    updated.add_metric([], state.updated_at or 0.0)
    failing = _gauge("dashboard_poll_failing", "1 if the last poll of the DHT failed", [])
    failing.add_metric([], float(state.poll_error is not None))
    errors = _gauge("dashboard_reachability_errors", "Distinct recent reachability errors kept", [])
    errors.add_metric([], float(len(state.errors)))
    yield from (updated, failing, errors)


def make_registry(get_state: Callable[[], State]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StateCollector(get_state))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
