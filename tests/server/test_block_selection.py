"""Servers started with --num-blocks place themselves where the swarm needs them: gaps first."""

from __future__ import annotations

import time

from swarm.local import LocalSwarm
from tests.kit.swarms import SERVER_ARGS

# these tests start their --num-blocks servers one at a time, each once the one before is seen:
# no two read the swarm together, so no random wait before the read and a short settle after it
ONE_AT_A_TIME = ["--join-jitter", "0", "--join-settle", "0.5"]


def test_num_blocks_servers_cover_the_model_then_add_redundancy(tiny_llama_path, artifacts_dir):
    from protocol.dht import make_dht
    from protocol.dht_records import fetch_servers

    with LocalSwarm(
        str(tiny_llama_path),
        spans=[(0, 2)],
        server_args=SERVER_ARGS + ONE_AT_A_TIME,
        names=["seed"],
        log_dir=str(artifacts_dir / "block-selection"),
    ) as swarm:
        dht = make_dht(initial_peers=swarm.initial_peers, client_mode=True)
        try:
            spans = {}
            for name in ["first", "second", "third"]:  # one after another, each seeing the ones before
                swarm.start_server(None, 2, name=name)
                deadline = time.monotonic() + 120
                while name not in spans and time.monotonic() < deadline:
                    spans.update(
                        {s.public_name: (s.start_block, s.end_block) for s in fetch_servers(dht, swarm.dht_name, 6)}
                    )
                    time.sleep(0.5)
            covered = sorted([spans["seed"], spans["first"], spans["second"]])
            assert covered == [(0, 2), (2, 4), (4, 6)], spans  # the first two filled the gaps
            assert spans["third"] in [(0, 2), (2, 4), (4, 6)]  # then redundancy on an equal-throughput swarm
        finally:
            dht.shutdown()


def test_running_server_moves_to_a_gap(tiny_llama_path, artifacts_dir):
    """A --num-blocks server sitting on a well-served range moves to blocks that lost their only
    server: it loads them beside its old span (both fit its memory), and announces them only once
    they serve."""

    from protocol.dht import make_dht
    from protocol.dht_records import fetch_servers
    from swarm.local import kill_group

    # --update-period 2 (after SERVER_ARGS' 5: the last wins): the killed server's record expires 6 s
    # after its last announcement instead of 15, and the mover sees the gap that much sooner
    args = SERVER_ARGS + ["--balance-period", "3", "--drain-seconds", "1", "--update-period", "2", *ONE_AT_A_TIME]
    with LocalSwarm(
        str(tiny_llama_path),
        spans=[(0, 2), (2, 4), (4, 6)],
        server_args=args,
        names=["a", "b", "c"],
        log_dir=str(artifacts_dir / "block-move"),
    ) as swarm:
        dht = make_dht(initial_peers=swarm.initial_peers, client_mode=True)

        def spans() -> dict:
            return {
                s.public_name: (s.start_block, s.end_block, s.state.value)
                for s in fetch_servers(dht, swarm.dht_name, 6)
            }

        def wait_for(condition, seconds=120):
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                current = spans()
                if condition(current):
                    return current
                time.sleep(0.5)
            raise AssertionError(f"timed out; swarm is {spans()}")

        try:
            swarm.start_server(None, 2, name="mover")
            before = wait_for(lambda s: "mover" in s)["mover"]
            victim = {(0, 2): 0, (2, 4): 1, (4, 6): 2}[before[:2]]
            victim = (victim + 1) % 3  # take away a range the mover does not cover
            kill_group(swarm.servers[victim])
            gap = [(0, 2), (2, 4), (4, 6)][victim]
            after = wait_for(lambda s: s.get("mover", (None, None, None))[:2] == gap and s["mover"][2] == "online")
            assert after["mover"][:2] == gap
            log = (artifacts_dir / "block-move" / "mover.log").read_text()
            assert f"to {gap[0]}:{gap[1]} (loading beside the old span)" in log and "Serving blocks" in log
            assert log.index("loading beside the old span") < log.index(f"Serving blocks {gap[0]}:{gap[1]} (moved)")
        finally:
            dht.shutdown()
