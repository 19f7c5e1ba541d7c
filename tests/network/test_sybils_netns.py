"""Two sybil tails on one host, an honest tail on another, in network namespaces (issue 35: "tests give
servers distinct addresses in network namespaces"; needs root, iproute2).

Everywhere else the sybil tests run on 127.0.0.1, where client/_witnesses.py counts each peer id as a
machine group of its own (a loopback server is the user's own), so they patch ``machine_group`` to put
two sybils on one /24. Here nothing is patched: hosts ``h`` (bootstrap and head H, blocks 0:3), ``t``
(honest tail T, 3:6) and ``s`` (sybils L1 and L2, 3:6, one address) each have an address of their own on
the testbed's bridge, and the client runs on ``cli``. The groups are what the client's own libp2p daemon
says its connections run over. L1 and L2 tell the same lie (the model's second choice) in every verdict
from position 32; L1 is the preferred live tail, then T, then L2; nobody is trusted.

- The client must group L1 and L2 together (one private address) and T and H apart.
- Without the LM-head rows (no evidence): L2 may not witness for L1, so T shadows, disputes, and
  nothing settles it; the generation falls back on T and flags what nobody independent confirmed.
  Had L2 counted as independent, it would have confirmed L1's lies (test_sybils.py shows the pool).
- With the rows: the evidence refutes L1, never T; the generation ends on T.
Both: output equal to local transformers, T never convicted, banned or excluded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.kit import netns
from tests.kit.reference import PROMPT
from tests.kit.swarms import SERVER_ARGS

pytestmark = pytest.mark.timeout(420)

NEW_TOKENS = 40
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CLIENT = """
import json, sys, time, warnings
import torch
from client import _loop, _witnesses
from client.errors import UnconfirmedTokensError, UnconfirmedTokensWarning
from swarm import AutoDistributedModelForCausalLM
from tests.kit.reference import PROMPT
from tests.kit.routes import PreferredRoutes
from tests.kit.swarms import servers_by_name

path, peer, new_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = AutoDistributedModelForCausalLM.from_pretrained(path, initial_peers=[peer])
try:
    names = ("H", "T", "L1", "L2")
    deadline = time.monotonic() + 180
    while True:
        by_name = servers_by_name(model, model.config.num_hidden_layers)
        if all(getattr(by_name.get(n), "state", None) == "online" for n in names):
            break
        assert time.monotonic() < deadline, f"not all of {names} came online: {sorted(by_name)}"
        time.sleep(0.5)
    peers = {n: by_name[n].peer_id for n in names}
    model.swarm.router = PreferredRoutes(*[[("H", 0, 3), (tail, 3, 6)] for tail in ("L1", "T", "L2")])
    runs = {}

    def run(label, **kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = model.generate(torch.tensor(PROMPT), max_new_tokens=new_tokens, spot_check_rate=0.0, **kwargs)
        s = model.last_generation_stats
        runs[label] = {
            "tokens": out[0, len(PROMPT[0]):].tolist(),
            "disputed": sorted(s.disputed_peers),
            "convicted": sorted(s.liars_excluded),
            "route_tail": s.route[-1][0],
            "by_evidence": s.verdict_audits_by_evidence,
            "undecided": s.verdict_audits_undecided,
            "confirmed_untrusted": s.tokens_confirmed_untrusted,
            "unconfirmed": s.tokens_unconfirmed,
            "flag_warning": any(issubclass(w.category, UnconfirmedTokensWarning) for w in caught),
            "events": s.spot_check_events,
        }

    rows, model.lm_head_rows = model.lm_head_rows, None
    run("no evidence")
    model.lm_head_rows = rows
    run("evidence")
    witnesses = _witnesses.Witnesses()  # the groups as the client's own connections show them
    _loop.run(witnesses.refresh(model.swarm.p2p))
    groups = {n: witnesses.groups.get(p) for n, p in peers.items()}
    # T out of sight: L2 is the only other tail, and it may not witness for L1 (one address)
    model.swarm.excluded.add(peers["T"])
    run("T hidden")
    try:
        model.generate(torch.tensor(PROMPT), max_new_tokens=new_tokens, spot_check_rate=0.0, audit="required")
        runs["T hidden"]["required"] = "returned"
    except UnconfirmedTokensError as e:
        runs["T hidden"]["required"] = f"raised: {e}"
    print(json.dumps({
        "peers": peers,
        "groups": groups,
        "runs": runs,
        "liars": sorted(model.swarm.liars),
    }), flush=True)
finally:
    model.shutdown()
"""


@pytest.fixture
def bed():
    with netns.testbed_or_skip(["h", "t", "s", "cli"]) as testbed:
        yield testbed


def _server(bed, host: str, name: str, model: str, peer: str, blocks: str, log_dir, *fault: str) -> subprocess.Popen:
    launcher = ["tests.kit.faulty_server", *fault, "--"] if fault else ["swarm.server"]
    argv = [sys.executable, "-m", *launcher, "--model", model, "--initial-peers", peer, "--blocks", blocks]
    argv += ["--host", bed.ip(host), "--public-name", name, *SERVER_ARGS]
    with open(log_dir / f"{name}.log", "w") as log:  # the child keeps its own descriptor
        return bed.run(host, argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def test_sybils_on_one_host_are_one_machine_group_and_cannot_confirm_each_other(
    bed, tiny_llama_path, tiny_reference, tmp_path
):
    bootstrap = bed.run(
        "h",
        [sys.executable, "-m", "swarm.bootstrap", "--host", bed.ip("h")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    peer = bootstrap.stdout.readline().strip()
    assert peer.startswith(f"/ip4/{bed.ip('h')}/"), peer
    model = str(tiny_llama_path)
    lie = ("--lie-in-verdicts", "1", "--lie-after", "32")
    servers = [
        _server(bed, "h", "H", model, peer, "0:3", tmp_path),
        _server(bed, "t", "T", model, peer, "3:6", tmp_path),
        _server(bed, "s", "L1", model, peer, "3:6", tmp_path, *lie),
        _server(bed, "s", "L2", model, peer, "3:6", tmp_path, *lie),
    ]
    client = bed.run(
        "cli",
        [sys.executable, "-c", CLIENT, model, peer, str(NEW_TOKENS)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out, err = client.communicate(timeout=360)
    logs = {p.name: p.read_text()[-1500:] for p in tmp_path.glob("*.log")}
    assert client.returncode == 0, f"client failed: {err[-4000:]}\nserver logs: {logs}"
    assert all(s.poll() is None for s in servers), logs
    result = json.loads(out.strip().splitlines()[-1])
    peers, groups = result["peers"], result["groups"]
    print(f"\ngroups as the client saw them: {groups}")

    # the groups come from the addresses the client's own connections run over, nothing patched
    assert groups["L1"] == groups["L2"] == f"private:{bed.ip('s')}", groups
    assert groups["T"] == f"private:{bed.ip('t')}" and groups["H"] == f"private:{bed.ip('h')}", groups

    with torch.no_grad():
        expected = tiny_reference.generate(torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False)
    expected = expected[0, len(PROMPT[0]) :].tolist()
    sybils = {peers["L1"], peers["L2"]}
    runs = result["runs"]
    for label in ("no evidence", "evidence"):
        run = runs[label]
        print(f"{label}: {run['events']}")
        assert run["tokens"] == expected, (label, run["events"])
        assert run["convicted"] == [], (label, run["events"])
        assert run["route_tail"] == peers["T"], (label, run["events"])  # the generation ended on T
        assert peers["L1"] in run["disputed"], (label, run["events"])
    no_evidence, evidence, hidden = runs["no evidence"], runs["evidence"], runs["T hidden"]
    # nothing settles it, and no independent witness that has not disagreed with T is left: flagged
    assert peers["T"] in no_evidence["disputed"] and no_evidence["undecided"] >= 1
    assert no_evidence["unconfirmed"] > 0 and no_evidence["flag_warning"]
    # the evidence refutes the sybil (and its mate, should it witness next), never T
    assert evidence["by_evidence"] >= 1 and evidence["undecided"] == 0
    assert set(evidence["disputed"]) <= sybils, evidence["events"]
    assert peers["T"] not in result["liars"]
    # with T out of sight only L2 could confirm L1's tokens, and it shares L1's address: every token
    # (the lies past position 32 among them) is flagged, and audit="required" raises
    print(f"T hidden: {hidden['events']}; audit='required' {hidden['required']}")
    assert hidden["route_tail"] in sybils and hidden["tokens"] != expected
    assert hidden["confirmed_untrusted"] == 0 and hidden["unconfirmed"] == NEW_TOKENS and hidden["flag_warning"]
    assert hidden["required"].startswith("raised"), hidden["required"]
