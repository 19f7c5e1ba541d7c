"""A new server of a hub model pins the commit the swarm serves, not the hub's main now
(server/model_source.py); ``--revision`` wins. No network: huggingface_hub's ``HfApi.model_info``
(what ``protocol.models.hub_commit`` asks) and the config loader are stand-ins, the DHT is real
(one in-process peer on 127.0.0.1 holding a record).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from transformers import AutoConfig

from protocol.records import ServerInfo, ServerState
from server.model_source import swarm_revision

MAIN, OLD, OTHER, MINE = "b" * 40, "a" * 40, "c" * 40, "d" * 40


def rec(peer: str, start: int, end: int, revision: str, state=ServerState.ONLINE) -> ServerInfo:
    return ServerInfo(peer_id=peer, model="org--tiny", start_block=start, end_block=end, state=state, revision=revision)


def test_the_revision_with_the_most_served_blocks_wins(caplog):
    caplog.set_level("INFO", logger="server.model_source")
    servers = [
        rec("p1", 0, 2, OTHER),
        rec("p2", 2, 4, OTHER),
        rec("p3", 0, 6, OLD),
        rec("p4", 0, 6, MAIN, ServerState.JOINING),
        rec("p5", 0, 6, "sha256:" + "0" * 32),
        rec("p6", 0, 6, "main"),
    ]
    assert swarm_revision(servers) == OLD  # 6 blocks against 4; joining records and non-commits do not count
    assert "several revisions" in caplog.text and f"taking {OLD[:12]}" in caplog.text
    assert swarm_revision(servers[:2] + [rec("p3", 0, 4, OLD)]) == OLD  # a tie: the smaller commit id
    assert swarm_revision(servers[3:]) is None


class Stop(Exception):
    """Raised by the stand-in weights loader: the test ends where downloading would begin."""


@pytest.fixture()
def fake_hub(monkeypatch, tiny_llama_path):
    """The hub's main is MAIN; every config read returns the tiny Llama's config and is recorded,
    and so is the revision the weights would be downloaded at."""
    import huggingface_hub

    from server import model_source, span_server

    seen = SimpleNamespace(config=[], weights=[])
    real = AutoConfig.from_pretrained(tiny_llama_path)

    class FakeAutoConfig:
        @staticmethod
        def from_pretrained(source, local_files_only=False, revision=None):
            seen.config.append((source, revision))
            return real

    def checkpoint(source, revision=None):
        seen.weights.append((source, revision))
        raise Stop()

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo, **kw: SimpleNamespace(sha=MAIN))
    monkeypatch.setattr(model_source, "AutoConfig", FakeAutoConfig)
    monkeypatch.setattr(model_source, "hub_reachable", lambda: True)
    monkeypatch.setattr(span_server, "hub_reachable", lambda: True)
    monkeypatch.setattr(span_server, "Checkpoint", checkpoint)
    return seen


def test_a_new_server_pins_the_revision_the_swarm_announces(fake_hub, tmp_path):
    from protocol.dht import make_dht
    from protocol.dht_records import announce
    from protocol.identity import load_or_create_identity
    from server.span_server import ServerConfig, SpanServer

    dht = make_dht(host="127.0.0.1", identity=load_or_create_identity(None), reachability="public")  # signs records
    try:
        peer = dht.peer_id.to_base58()
        announce(dht, rec(peer, 0, 4, OLD), expiration=60, wait=True, num_blocks=6)  # an ONLINE server of OLD
        peers = [str(a) for a in dht.get_visible_maddrs()]

        def create(**fields):
            config = ServerConfig(
                model="org/tiny",
                initial_peers=peers,
                host="127.0.0.1",
                reachability="public",
                identity_path=str(tmp_path / "id.key"),
                **fields,
            )
            with pytest.raises(Stop):
                asyncio.run(SpanServer.create(config))

        create()  # the swarm serves OLD: the weights come from OLD, not from the hub's main
        assert fake_hub.weights == [("org/tiny", OLD)] and fake_hub.config[-1] == ("org/tiny", OLD)
        create(revision=MINE)  # the volunteer's --revision wins
        assert fake_hub.weights[-1] == ("org/tiny", MINE) and fake_hub.config[-1] == ("org/tiny", MINE)
    finally:
        dht.shutdown()


def test_without_a_served_revision_or_with_one_the_hub_lacks_main_is_pinned(fake_hub, monkeypatch, caplog):
    from server import model_source

    caplog.set_level("INFO", logger="server.model_source")
    records: list[ServerInfo] = []
    monkeypatch.setattr(model_source, "fetch_servers", lambda dht, name, total: records)
    assert model_source.adopt_swarm_revision(None, "org--tiny", "org/tiny") == MAIN  # nobody online
    records.append(rec("p1", 0, 6, OTHER))
    real = model_source.AutoConfig.from_pretrained

    def missing_commit(source, local_files_only=False, revision=None):
        if revision == OTHER:
            raise OSError(f"{revision} is not a valid git identifier")
        return real(source, local_files_only, revision)

    monkeypatch.setattr(model_source.AutoConfig, "from_pretrained", missing_commit)
    assert model_source.adopt_swarm_revision(None, "org--tiny", "org/tiny") == MAIN
    assert f"The swarm serves org/tiny at {OTHER}, which the hub does not serve" in caplog.text
