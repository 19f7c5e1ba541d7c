"""Servers started with --num-blocks place themselves where the swarm needs them: gaps first."""

from __future__ import annotations

import time

from swarm.local import LocalSwarm
from tests.conftest import SERVER_ARGS


def test_num_blocks_servers_cover_the_model_then_add_redundancy(tiny_llama_path, artifacts_dir):
    import hivemind

    from swarm.dht_records import fetch_servers
    from swarm.validation import PeerIdSignatureValidator

    with LocalSwarm(str(tiny_llama_path), spans=[(0, 2)], server_args=SERVER_ARGS, names=["seed"],
                    log_dir=str(artifacts_dir / "block-selection")) as swarm:  # fmt: skip
        dht = hivemind.DHT(initial_peers=swarm.initial_peers, client_mode=True, start=True,
                           record_validators=[PeerIdSignatureValidator()])  # fmt: skip
        try:
            spans = {}
            for name in ["first", "second", "third"]:  # one after another, each seeing the ones before
                swarm.start_server(None, 2, name=name)
                deadline = time.monotonic() + 120
                while name not in spans and time.monotonic() < deadline:
                    spans.update({s.public_name: (s.start_block, s.end_block) for s in fetch_servers(dht, swarm.dht_name, 6)})
                    time.sleep(0.5)
            covered = sorted([spans["seed"], spans["first"], spans["second"]])
            assert covered == [(0, 2), (2, 4), (4, 6)], spans  # the first two filled the gaps
            assert spans["third"] in [(0, 2), (2, 4), (4, 6)]  # then redundancy on an equal-throughput swarm
        finally:
            dht.shutdown()
