"""Where a machine's swarm settings come from when the command line does not say.

A volunteer configures a machine once (an environment variable in a service unit, or a file
in the user's config folder) and then runs the exact command the project promises:
``python -m swarm.server --model deepseek-v4-pro``. The order is the usual one: the command
line, then the environment, then the file.

The file is TOML, ``$XDG_CONFIG_HOME/specswarm/config.toml`` (``~/.config/specswarm/config.toml``
by default)::

    initial_peers = ["/ip4/203.0.113.7/tcp/31337/p2p/Qm..."]
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

ENV_INITIAL_PEERS = "SPECSWARM_INITIAL_PEERS"  # multiaddrs separated by spaces or commas


def config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "specswarm" / "config.toml"


@dataclass(frozen=True)
class InitialPeers:
    peers: list[str]
    source: str  # where they came from, for the log

    def describe(self) -> str:
        return f"Initial peers from {self.source}: {' '.join(self.peers)}"


def resolve_initial_peers(given: Sequence[str] = ()) -> InitialPeers:
    """The first non-empty of: ``given`` (--initial-peers), $SPECSWARM_INITIAL_PEERS, the config
    file's ``initial_peers``; each address checked to be a multiaddr. Empty if none is set."""
    if given:
        return InitialPeers(_checked(given, "--initial-peers"), "--initial-peers")
    env = os.environ.get(ENV_INITIAL_PEERS, "").replace(",", " ").split()
    if env:
        return InitialPeers(_checked(env, ENV_INITIAL_PEERS), f"${ENV_INITIAL_PEERS}")
    path = config_path()
    if path.is_file():
        try:
            peers = tomllib.loads(path.read_text()).get("initial_peers", [])
        except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read {path}: {e}") from None
        if isinstance(peers, str):
            peers = peers.replace(",", " ").split()
        if not isinstance(peers, list) or not all(isinstance(p, str) for p in peers):
            raise ValueError(f"{path}: initial_peers must be a list of multiaddr strings")
        if peers:
            return InitialPeers(_checked(peers, str(path)), str(path))
    return InitialPeers([], "")


def no_initial_peers_message(what: str = "join a swarm", argument: str = "--initial-peers MADDR [MADDR ...]") -> str:
    return (
        f"no initial peers to {what}: pass {argument}, "
        f'or set {ENV_INITIAL_PEERS}="MADDR ...", '
        f'or write initial_peers = ["MADDR", ...] to {config_path()}'
    )


def _checked(peers: Sequence[str], source: str) -> list[str]:
    from multiaddr import Multiaddr

    for peer in peers:
        try:
            Multiaddr(peer)
        except Exception as e:
            raise ValueError(f"{source}: {peer!r} is not a multiaddr ({e})") from None
    return list(peers)
