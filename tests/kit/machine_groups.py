"""Servers of one operator, as the client would see them on the internet: on loopback every server
shares 127.0.0.1, so client/_witnesses.py gives each peer id a machine group of its own; a test of
sybils puts the ones it names on one /24, the cheapest way an operator runs many identities."""

from __future__ import annotations

from typing import Collection

ONE_MACHINE = "net:203.0.113.0/24"  # a documentation range (RFC 5737): no real server is there


def on_one_machine(monkeypatch, peer_ids: Collection[str]) -> None:
    """``peer_ids`` share the machine group ``ONE_MACHINE``; every other peer keeps its own."""
    from client import _witnesses

    group = _witnesses.machine_group
    monkeypatch.setattr(
        _witnesses, "machine_group", lambda addr, peer_id: ONE_MACHINE if peer_id in peer_ids else group(addr, peer_id)
    )
