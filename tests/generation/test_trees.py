"""Token trees of drafts (issue 16; docs/protocol.md, "Token trees"): the tree walk and layout, trees
over real servers giving the output of no speculation, every server's cache after a tree run equal
to the accepted chain's, and malformed trees refused by name while the session goes on."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets

import msgspec
import pytest
import torch
from hivemind.p2p import PeerID

from client import _loop
from client._trees import DraftTree, PendingPath, TreeSizer, build_tree
from client.drafting import SuffixDrafter
from client.errors import GenerationError
from protocol import trees
from protocol.errors import ErrorCode
from protocol.limits import MAX_TREE_NODES
from protocol.messages import (
    ErrorReply,
    Hop,
    OpenSession,
    SamplingParams,
    SessionOpened,
    Step,
    StepResult,
    Subscribe,
    decode,
    encode,
)
from protocol.sampling import choose_token, pack_f16, verify, verify_tree
from protocol.streams import RESULTS_PROTOCOL, SESSION_PROTOCOL, MessageStream
from protocol.tail_costs import TailCosts
from server.adapters import load_span
from server.weights import Checkpoint
from tests.kit.drafters import ScriptedDrafter
from tests.kit.reference import PROMPT
from tests.kit.routes import ROUTES, pinned
from tests.kit.swarms import inprocess_servers
from tests.kit.threads import single_torch_thread

# ---- the walk, the layout and the checks, on fabricated logits -----------------------------------

VOCAB = 12


def fake_logits(context) -> torch.Tensor:
    """A deterministic 'model': logits that depend on the whole context."""
    seed = int.from_bytes(hashlib.blake2b(repr(list(context)).encode(), digest_size=8).digest(), "little") >> 1
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def tree_rows(history, committed, ids, parents):
    """The logits rows a server computes for a tree run: row i is the output at the run's i-th id."""
    rows = [fake_logits(history + committed[: i + 1]) for i in range(len(committed))]
    for node in range(len(parents)):
        path = DraftTree(list(ids), list(parents), [0.0] * len(ids), trees.depths(parents)).path_to(node)
        rows.append(fake_logits(history + committed + [ids[n] for n in path]))
    return torch.stack(rows)


def one_at_a_time(context, start, count, params):
    out = list(context)
    for _ in range(count):
        out.append(choose_token(fake_logits(out), out, len(out), params))
    return out[start:]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(do_sample=True, temperature=0.9, top_k=6, seed=3),
        SamplingParams(do_sample=True, temperature=1.2, repetition_penalty=2.0, seed=8),
    ],
    ids=["greedy", "greedy+penalty", "seeded", "seeded+penalty"],
)
def test_tree_walk_equals_chain_walk(params):
    history, committed = [3, 1, 4, 1, 5], [9]
    truth = one_at_a_time(history + committed, len(history) + len(committed), 5, params)
    wrong = [(t + 1) % VOCAB for t in truth]
    cases = {  # (ids, parents): the truth down a late branch, behind wrong siblings, deep and wide
        "chain right": (truth[:3], [-1, 0, 1]),
        "second branch": ([wrong[0], truth[0], wrong[1], truth[1]], [-1, -1, 1, 1]),
        "deep right under wide wrong": (
            [wrong[0], wrong[0] + 0, truth[0], wrong[1], wrong[1], truth[1], truth[2], truth[3]],
            [-1, 0, -1, 2, 0, 2, 5, 6],
        ),
        "all wrong": ([wrong[0], (wrong[0] + 1) % VOCAB], [-1, -1]),
    }
    for name, (ids, parents) in cases.items():
        token_ids = committed + ids
        logits = tree_rows(history, committed, ids, parents)
        start = len(history)
        path, next_token, _ = verify_tree(logits, history + token_ids, start, token_ids, parents, params)
        trees.check_path(path, parents)
        accepted = [ids[n] for n in path]
        assert accepted + [next_token] == truth[: len(path) + 1], name
        # the chain walk over the accepted path (plus one wrong draft) says the same
        chain = accepted + [(truth[len(path)] + 1) % VOCAB] if len(path) < len(truth) else accepted
        chain_logits = tree_rows(history, committed, chain, list(range(-1, len(chain) - 1)))
        got = verify(chain_logits, history + committed + chain, start, len(chain), params)[:2]
        assert got == (len(path), next_token), name


def test_tree_walk_reads_rows_only_along_its_path():
    params = SamplingParams()
    history, committed = [2, 7], [5]
    truth = one_at_a_time(history + committed, 3, 3, params)
    ids, parents = [truth[0], (truth[0] + 1) % VOCAB, truth[1], (truth[1] + 3) % VOCAB], [-1, -1, 0, 1]
    rows = tree_rows(history, committed, ids, parents)

    class Recording:
        read = []

        def __len__(self):
            return len(rows)

        def __getitem__(self, row):
            self.read.append(row)
            return rows[row]

    recording = Recording()
    path, next_token, _ = verify_tree(recording, history + committed + ids, 2, committed + ids, parents, params)
    assert path == [0, 2] and next_token == truth[2]
    assert recording.read == [0, 1, 3]  # the root's row, then node 0's, then node 2's


def test_tree_positions_and_mask_for_a_small_tree():
    from server.adapters.llama import _tree_positions_and_mask

    # committed ids c0 c1, then drafts: 0 (root child), 1 (child of 0), 2 (root child), 3 (child of 1)
    parents = [-1, 0, -1, 1]
    assert trees.depths(parents) == [1, 2, 1, 3]
    assert trees.offsets(2, parents) == [0, 1, 2, 3, 2, 4]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 1, 1, 1, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(trees.visibility(2, parents), expected)
    position_ids, mask = _tree_positions_and_mask(10, 6, parents, torch.device("cpu"))
    assert position_ids.tolist() == [[10, 11, 12, 13, 12, 14]]
    assert mask.shape == (1, 1, 6, 16) and bool(mask[0, 0, :, :10].all())
    assert torch.equal(mask[0, 0, :, 10:], expected)


@pytest.mark.parametrize(
    "parents, n_draft, phrase",
    [
        ([-1, 5], 2, "parents[1] = 5 is out of range"),
        ([-2], 1, "parents[0] = -2 is out of range"),
        ([1, -1], 2, "parents[0] = 1 does not come before its child"),
        ([-1, 1], 2, "parents[1] = 1 does not come before its child"),
        ([-1, 0], 3, "parents has 2 entries for 3 drafts"),
        ([-1] * (MAX_TREE_NODES + 1), MAX_TREE_NODES + 1, f"exceeds the limit of {MAX_TREE_NODES} nodes"),
    ],
)
def test_malformed_trees_are_named(parents, n_draft, phrase):
    with pytest.raises(ValueError, match=phrase.replace("[", r"\[").replace("]", r"\]")):
        trees.check_tree(parents, n_draft, MAX_TREE_NODES)


def test_chain_steps_keep_their_bytes_and_trees_round_trip():
    chain = Step(session_id="0123456789abcdef", run_id=3, start_pos=10, token_ids=[5, 6, 7], n_draft=2)
    assert encode(chain)[3:8] == b"\xa4step" and chain.parents == [] and chain.tree_path == []
    tree = Step(
        session_id="0123456789abcdef",
        run_id=3,
        start_pos=10,
        token_ids=[5, 6, 7],
        n_draft=2,
        parents=[-1, -1],
        tree_path=[1, 4],
    )
    assert decode(encode(tree)) == tree and len(encode(tree)) > len(encode(chain))
    # the tree's fields sit at the end of the Step: a chain's array stops before them
    assert len(encode(chain)) == len(encode(msgspec.structs.replace(tree, parents=[], tree_path=[])))
    result = StepResult(session_id="s", run_id=1, accepted=2, next_token=9, path=[1, 3])
    assert decode(encode(result)) == result and decode(encode(result)).path == [1, 3]


def test_deepseek_v4_servers_refuse_trees():
    from protocol.errors import ProtocolError
    from server.adapters.deepseek_v4 import DeepseekV4Adapter
    from server.session import ServerSession

    span = DeepseekV4Adapter.__new__(DeepseekV4Adapter)
    span.vocab_size, span.hidden_shape = 100, (4, 8)
    session = ServerSession("s", 64, [Hop("p", 0, 2)], 0, cache=None)
    session.check_step(
        Step(session_id="s", run_id=1, start_pos=0, token_ids=[1, 2, 3], n_draft=2), None, span
    )  # a chain
    with pytest.raises(ProtocolError, match="DeepseekV4Adapter.*chains of drafts only") as e:
        session.check_step(
            Step(session_id="s", run_id=2, start_pos=0, token_ids=[1, 2, 3], n_draft=2, parents=[-1, -1]), None, span
        )
    assert e.value.code == ErrorCode.BAD_REQUEST


# ---- the client's tree and its size ----------------------------------------------------------------


def test_build_tree_puts_the_chain_first_then_ranked_branches():
    text = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 7, 1, 2]  # after "1 2": 3 twice, 5 once
    drafter = SuffixDrafter(8)
    drafter.reset(text)
    chain = drafter.draft(4)
    tree = build_tree(drafter, chain, max_nodes=10, max_depth=4)
    assert tree.ids[: len(chain)] == chain and tree.parents[: len(chain)] == list(range(-1, len(chain) - 1))
    assert tree.chain_len == len(chain) and 3 <= len(chain) < len(tree) <= 10
    trees.check_tree(tree.parents, len(tree), 10)
    assert max(tree.depths) <= 4
    root_children = {tree.ids[n] for n, p in enumerate(tree.parents) if p == -1}
    assert root_children == {3, 5}  # the chain's 3 and the alternative 5
    assert all(0 < s <= 1 for s in tree.scores)


def test_tree_sizer_grows_trees_when_the_lap_is_network_bound():
    scores = [0.9, 0.6, 0.3, 0.2, 0.15, 0.1, 0.08, 0.05, 0.04, 0.03] + [0.02] * 20
    tree = DraftTree(list(range(30)), [-1] * 30, scores, [1] * 30)
    sizes = {}
    for name, fixed, per_position in (("network-bound", 0.2, 0.0005), ("compute-bound", 0.02, 0.01)):
        sizer = TreeSizer()
        assert sizer.choose(tree, committed=1) == 4  # nothing measured yet: the chain (none here) + EXPLORE
        for positions in (300, 1, 5, 12, 3, 30, 2, 8) * 3:  # a prefill (out of the fit), then runs of several sizes
            sizer.observe_lap(positions, fixed + per_position * positions)
        assert sizer.fitted and sizer.fixed == pytest.approx(fixed, rel=0.1)
        assert sizer.per_position == pytest.approx(per_position, rel=0.3)  # shrunk a little towards the prefill's
        for _ in range(5):  # scores worth what they say at depth 1
            sizer.observe_acceptance(DraftTree([1, 2], [-1, -1], [0.6, 0.4], [1, 1]), accepted=1)
        sizes[name] = sizer.choose(tree, committed=1)
    assert sizes["network-bound"] > 2 * sizes["compute-bound"] >= 2, sizes


def test_tree_sizer_calibrates_scores_per_depth():
    sizer = TreeSizer()
    chain = DraftTree([1, 2, 3, 4], [-1, 0, 1, 2], [1.0] * 4, [1, 2, 3, 4])  # retrieval's 1.0 at every depth
    for _ in range(30):
        sizer.observe_acceptance(chain, accepted=1)  # the first draft right, the second never
    assert sizer.calibration(1) > 0.9 and sizer.calibration(2) < 0.1 and sizer.calibration(4) < 0.1
    compute_bound, network_bound = TreeSizer(), TreeSizer()
    for sizer_of, fixed, per_position in ((compute_bound, 0.01, 0.01), (network_bound, 0.1, 0.001)):
        sizer_of._predicted, sizer_of._reached = sizer._predicted, sizer._reached
        for _ in range(5):
            sizer_of.observe_lap(1, fixed + per_position), sizer_of.observe_lap(20, fixed + 20 * per_position)
    assert compute_bound.choose(chain, committed=1) == 1  # deeper nodes are worth less than they cost
    assert network_bound.choose(chain, committed=1) == 4  # 1 ms is little against a 100 ms network


def test_tree_sizer_does_not_take_noise_for_free_nodes():
    """Lap times that vary more than the run sizes explain (a busy machine) leave the slope near the
    prefill's seconds per position instead of fitting zero."""
    import random

    rng = random.Random(4)
    sizer = TreeSizer()
    sizer.observe_lap(200, 2.0)  # the prompt: 10 ms a position, fixed part included
    for _ in range(30):
        positions = rng.choice([1, 2, 9])
        sizer.observe_lap(positions, rng.uniform(0.2, 0.5))  # no visible dependence on size
    assert sizer.per_position > 0.002


# ---- the tree's size from the tail's reported costs (issue 39) ------------------------------------

CALL_S, ROW_S = 0.016, 0.0001  # a memory-bound tail's LM-head call and one more row


def sized_by_parts(link_s: float, tail_per_node_s: float) -> tuple[TreeSizer, int]:
    """A sizer fed laps of ``link_s`` of network (every hop's latency, 1 ms a position before the
    tail) and a tail that reports ``tail_per_node_s`` of blocks per position and one LM-head call:
    the sizer and the size it chooses for a tree whose scores the verdicts confirm."""
    sizer = TreeSizer()
    for positions in (300, 1, 5, 12, 3, 30, 2, 8) * 3:
        head_s = CALL_S + ROW_S * positions
        tail = TailCosts(round(tail_per_node_s * positions * 1e6), [round(head_s * 1e6)], [positions])
        sizer.observe_lap(positions, link_s + 0.001 * positions + tail_per_node_s * positions + head_s, tail)
    for _ in range(5):
        sizer.observe_acceptance(DraftTree([1, 2], [-1, -1], [0.6, 0.4], [1, 1]), accepted=1)
    scores = [0.9, 0.6, 0.3, 0.2, 0.15, 0.1, 0.08, 0.05, 0.04, 0.03] + [0.02] * 20
    return sizer, sizer.choose(DraftTree(list(range(30)), [-1] * 30, scores, [1] * 30), committed=1)


def test_tree_sizer_prices_the_tails_report_apart_from_the_network():
    sizer, _ = sized_by_parts(0.15, 0.004)
    assert sizer.fitted and sizer.fixed == pytest.approx(0.15, rel=0.1)  # the network's part alone
    assert sizer.per_position == pytest.approx(0.001, rel=0.3)
    call_s, per_position_s = sizer.tail_costs()
    assert call_s == pytest.approx(CALL_S, rel=0.01) and per_position_s == pytest.approx(0.004 + ROW_S, rel=0.01)
    assert sizer.lap_time(10) == pytest.approx(0.15 + CALL_S + 10 * (0.001 + 0.004 + ROW_S), rel=0.1)
    assert TreeSizer().tail_costs() == (0.0, 0.0)  # no report: the wall-clock fit holds the tail's part


def test_a_slower_tail_per_node_gives_smaller_trees_at_the_same_link():
    sizes = [sized_by_parts(0.15, tail_ms / 1000)[1] for tail_ms in (0.5, 4, 20, 80)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 2 * sizes[-1] >= 2, sizes


def test_more_link_delay_gives_larger_trees_at_the_same_tail_cost():
    sizes = [sized_by_parts(link_ms / 1000, 0.01)[1] for link_ms in (5, 50, 150, 600)]
    assert sizes == sorted(sizes) and sizes[-1] > 2 * sizes[0] >= 2, sizes


def test_the_second_lm_head_call_of_an_accepted_walk_is_priced():
    """A walk past the root costs the tail one more LM-head call (server/compute.py's LazyLogits), in
    proportion to the chance that a first-level node is accepted: with a free link and a 16 ms call,
    unlikely first-level siblings of a likely chain cost more in second calls than they bring; on a
    500 ms link the same siblings pay for themselves."""

    def sized(link_s: float) -> int:
        sizer = TreeSizer()
        for positions in (300, 1, 5, 12, 3, 30, 2, 8) * 3:
            tail = TailCosts(100 * positions, [16000], [1])  # 0.1 ms a position, a 16 ms LM-head call
            sizer.observe_lap(positions, link_s + 0.0001 * positions + 0.016, tail)
        for _ in range(30):  # the scores are right: calibration near 1 at depths 1..3
            sizer.observe_acceptance(DraftTree([1, 2, 3], [-1, 0, 1], [1.0, 1.0, 1.0], [1, 2, 3]), accepted=3)
        tree = DraftTree(
            list(range(7)), [-1, 0, 1, -1, -1, -1, -1], [0.9, 0.8, 0.7] + [0.04] * 4, [1, 2, 3, 1, 1, 1, 1]
        )
        return sizer.choose(tree, committed=1)

    assert sized(0.0) == 3  # the chain alone
    assert sized(0.5) == 7


def test_fixed_lap_costs_size_trees_from_the_verdicts_alone():
    """``TreeSizer(lap_costs)`` (generate(draft_lap_costs=...)): measured laps change nothing; (1.0, 0.0)
    makes positions free, so every node with a chance is sent."""
    tree = DraftTree(list(range(12)), [-1] * 12, [0.5 / (i + 1) for i in range(12)], [1] * 12)
    priced, free = TreeSizer((0.05, 0.01)), TreeSizer((1.0, 0.0))
    before = priced.choose(tree, committed=1)
    for positions, seconds in ((1, 9.0), (30, 0.001), (5, 3.0)):
        priced.observe_lap(positions, seconds, TailCosts(1000, [16000], [1]))
    assert priced.choose(tree, committed=1) == before and 0 < before < len(tree)
    assert priced.tail_costs() == (0.0, 0.0) and (priced.fixed, priced.per_position) == (0.05, 0.01)
    assert free.choose(tree, committed=1) == len(tree)
    with pytest.raises(ValueError, match="draft_lap_costs must be"):
        TreeSizer((0.05, -1.0))


def test_pending_path_names_only_what_is_not_a_run_order_chain():
    assert PendingPath(0, 20, [0, 1, 2]).tree_path_for(23) is None  # the chain in run order: implicit
    assert PendingPath(0, 20, [0, 3, 4]).tree_path_for(23) == [0, 3, 4]
    assert PendingPath(0, 20, [0, 3, 4]).tree_path_for(21) is None  # keeps node 0 only
    assert PendingPath(0, 20, [2, 3]).tree_path_for(20) is None  # drops the tree


# ---- trees through real servers: the output of no speculation -------------------------------------


class ScriptedTreeDrafter(ScriptedDrafter):
    """A ScriptedDrafter whose ranked alternatives hold the true next token (at offsets in
    ``right_branches``, on the true path only) among wrong ones, so trees branch right and wrong."""

    def __init__(self, truth, prompt_len, wrong_at, length, right_branches, width=3):
        super().__init__(truth, prompt_len, wrong_at, length)
        self.right_branches, self.width = right_branches, width

    def ranked(self, k, after=()):
        start = self.position + len(after)
        true = self.truth[start] if start < len(self.truth) else 0
        out = [((true + 2 + i) % 1000, 0.3 / (i + 1)) for i in range(self.width)]
        if start in self.right_branches and list(after) == self.truth[self.position : start]:
            out.insert(1, (true, 0.25))  # behind a wrong sibling
        return out[:k]


@contextlib.contextmanager
def full_trees(monkeypatch):
    """Send every tree whole (the cost model has its own tests): the tests choose the shapes."""
    monkeypatch.setattr("client._trees.TreeSizer.choose", lambda self, tree, committed: len(tree))
    yield


TREE_CASES = {  # wrong_at (chain drafts), right_branches (offsets where an alternative is the truth)
    "chain right, branches wrong": (set(), set()),
    "chain wrong, a branch right": (set(range(40)), set(range(40))),
    "mixed": ({1, 4, 5, 9, 12}, {4, 9, 10}),
    "all wrong": (set(range(40)), set()),
}


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("case", list(TREE_CASES))
def test_trees_give_the_output_of_no_speculation(tiny_model, tiny_reference, monkeypatch, case, sampling):
    kwargs = dict(do_sample=True, temperature=0.8, top_p=0.9, repetition_penalty=1.3, seed=7) if sampling else {}
    with pinned(tiny_model, ROUTES["three servers, uneven"]):
        plain = tiny_model.generate(torch.tensor(PROMPT), max_new_tokens=16, speculation=None, **kwargs)
        if not sampling:
            expected = tiny_reference.generate(torch.tensor(PROMPT), max_new_tokens=16, do_sample=False)
            assert plain.tolist() == expected.tolist()
        truth = plain[0, len(PROMPT[0]) :].tolist()
        wrong_at, right = TREE_CASES[case]
        drafter = ScriptedTreeDrafter(truth, len(PROMPT[0]), wrong_at, 4, right)
        monkeypatch.setattr("client._drafter_choice.make_drafter", lambda *a, **k: drafter)
        with full_trees(monkeypatch):
            output = tiny_model.generate(
                torch.tensor(PROMPT), max_new_tokens=16, num_draft_tokens=4, draft_tree=True, **kwargs
            )
    assert output.tolist() == plain.tolist()
    stats = tiny_model.last_generation_stats
    assert stats.tree_laps == stats.laps and stats.tree_nodes > stats.laps * 4  # branches went out
    assert max(stats.tree_sizes) <= MAX_TREE_NODES
    if case == "chain right, branches wrong":
        assert stats.laps == 4 and stats.tree_accepted == 12  # 4 drafts a lap, the last lap cut short
    elif case == "chain wrong, a branch right":  # every lap accepts down a branch the chain missed
        assert stats.laps == 4 and stats.tree_accepted == 12
    elif case == "all wrong":
        assert stats.accepted == 0 and stats.laps == 16
    else:
        assert 0 < stats.accepted and stats.laps < 16


def test_deep_and_wide_trees(tiny_model, monkeypatch):
    with pinned(tiny_model, ROUTES["two servers"]):
        plain = tiny_model.generate(torch.tensor(PROMPT), max_new_tokens=20, speculation=None)
        truth = plain[0, len(PROMPT[0]) :].tolist()
        drafter = ScriptedTreeDrafter(truth, len(PROMPT[0]), set(range(0, 40, 3)), 8, set(range(0, 40, 3)), width=4)
        monkeypatch.setattr("client._drafter_choice.make_drafter", lambda *a, **k: drafter)
        with full_trees(monkeypatch):
            output = tiny_model.generate(torch.tensor(PROMPT), max_new_tokens=20, num_draft_tokens=8, draft_tree=True)
    assert output.tolist() == plain.tolist()
    stats = tiny_model.last_generation_stats
    assert max(stats.tree_sizes) == MAX_TREE_NODES  # 4 alternatives a node, 8 deep: the limit binds
    assert stats.laps <= 10 and stats.accepted >= 10  # down branches where the chain is wrong


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_suffix_trees_with_the_cost_model_match_no_speculation(tiny_model, sampling):
    kwargs = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=11) if sampling else {}
    prompt = torch.tensor([PROMPT[0] * 3])
    with pinned(tiny_model, ROUTES["two servers"]):
        plain = tiny_model.generate(prompt, max_new_tokens=24, speculation=None, **kwargs)
        tree = tiny_model.generate(prompt, max_new_tokens=24, speculation="suffix", draft_tree=True, **kwargs)
    assert tree.tolist() == plain.tolist()
    stats = tiny_model.last_generation_stats
    assert stats.tree_laps == stats.laps and stats.tree_nodes > 0


def test_fixed_lap_costs_repeat_tree_shapes(tiny_model, tiny_reference):
    """generate(draft_lap_costs=...) fixes the tree sizer's costs too: the same call twice sends the
    same trees (the suffix store reset between them), with transformers' tokens."""
    prompt = torch.tensor([PROMPT[0] * 3])
    expected = tiny_reference.generate(prompt, max_new_tokens=24, do_sample=False)
    shapes = []
    with pinned(tiny_model, ROUTES["two servers"]):
        for _ in range(2):
            tiny_model.reset_draft_store()
            output = tiny_model.generate(
                prompt, max_new_tokens=24, speculation="suffix", draft_tree=True, draft_lap_costs=(0.05, 0.002)
            )
            assert output.tolist() == expected.tolist()
            stats = tiny_model.last_generation_stats
            shapes.append((stats.laps, stats.tree_nodes, dict(stats.tree_sizes), stats.tree_accepted))
    assert shapes[0] == shapes[1] and shapes[0][1] > 0, shapes


def test_trees_in_batches_sessions_and_streams(tiny_model, monkeypatch):
    with pinned(tiny_model, ROUTES["two servers"]):
        whole = tiny_model.generate(torch.tensor(PROMPT), max_new_tokens=20, speculation=None)
        other = [PROMPT[0][3:]]
        other_plain = tiny_model.generate(torch.tensor(other), max_new_tokens=12, speculation=None)
        truth = whole[0, len(PROMPT[0]) :].tolist()
        with full_trees(monkeypatch):
            # an inference session: the second call's first Step keeps the first call's last tree path
            monkeypatch.setattr(
                "client._drafter_choice.make_drafter",
                lambda *a, **k: ScriptedTreeDrafter(truth, len(PROMPT[0]), {2, 9}, 3, {2, 9}),
            )
            with tiny_model.inference_session(max_length=160):
                first = tiny_model.generate(torch.tensor(PROMPT), max_new_tokens=8, num_draft_tokens=3, draft_tree=True)
                second = tiny_model.generate(first, max_new_tokens=12, num_draft_tokens=3, draft_tree=True)
            assert second.tolist() == whole.tolist()
            # a padded batch: each row its own tree session
            monkeypatch.setattr("client._drafter_choice.make_drafter", lambda *a, **k: SuffixDrafter(4))
            batch = torch.tensor([[0, 0, 0] + other[0], PROMPT[0]])
            mask = torch.tensor([[0, 0, 0] + [1] * len(other[0]), [1] * len(PROMPT[0])])
            out = tiny_model.generate(batch, attention_mask=mask, max_new_tokens=12, draft_tree=True)
            assert out[0, 3:].tolist() == other_plain[0].tolist()
            assert out[1].tolist() == whole[0, : len(PROMPT[0]) + 12].tolist()

            async def stream():
                return [
                    t
                    async for c in tiny_model.agenerate_stream(PROMPT[0], max_new_tokens=20, draft_tree=True)
                    for t in c.token_ids
                ]

            assert asyncio.run(stream()) == truth


def test_draft_tree_is_validated(tiny_model):
    prompt = torch.tensor(PROMPT)
    with pytest.raises(ValueError, match="draft_tree must be True or False"):
        tiny_model.generate(prompt, max_new_tokens=2, draft_tree="yes")
    with pytest.raises(ValueError, match="synchronous speculation"):
        tiny_model.generate(prompt, max_new_tokens=2, draft_tree=True, async_speculation=True)
    with pytest.raises(ValueError, match="verification='rejection'"):
        tiny_model.generate(prompt, max_new_tokens=2, draft_tree=True, verification="rejection", do_sample=True)


# ---- in-process servers: caches after a tree run, malformed trees, failover, chunked prefill ------


@pytest.fixture(scope="module")
def tree_servers(tiny_llama_path):
    yield from inprocess_servers(tiny_llama_path)


@pytest.fixture(scope="module")
def local_spans(tiny_llama_path):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_llama_path)
    return [
        load_span(config, Checkpoint(str(tiny_llama_path)), a, b, torch.float32, "cpu") for a, b in [(0, 3), (3, 6)]
    ]


class Raw:
    """A session spoken in raw protocol messages through the in-process servers."""

    def __init__(self, model, servers, max_length=160):
        self.p2p, self.max_length = model.swarm.p2p, max_length
        self.route = [Hop(s.info.peer_id, s.info.start_block, s.info.end_block) for s in servers]
        self.session_id = secrets.token_hex(8)
        self.run_id = 0

    async def open(self):
        self.tail = await MessageStream.open(self.p2p, PeerID.from_base58(self.route[-1].peer_id), RESULTS_PROTOCOL)
        await self.tail.send(Subscribe(session_id=self.session_id, secret="s"))
        self.head = await MessageStream.open(self.p2p, PeerID.from_base58(self.route[0].peer_id), SESSION_PROTOCOL)
        await self.head.send(
            OpenSession(
                session_id=self.session_id,
                max_length=self.max_length,
                route=self.route,
                hop_index=0,
                secret_hash=hashlib.sha256(b"s").hexdigest(),
            )
        )
        assert isinstance((await self.head.receive()).message, SessionOpened)

    async def step(self, start_pos, token_ids, n_draft=0, parents=(), tree_path=(), **extra):
        """Send one run; returns its StepResult, or the ErrorReply the head sent instead."""
        self.run_id += 1
        fields = dict(
            session_id=self.session_id,
            run_id=self.run_id,
            start_pos=start_pos,
            token_ids=list(token_ids),
            n_draft=n_draft,
            **extra,
        )
        message = Step(**fields, parents=list(parents), tree_path=list(tree_path))
        await self.head.send(message)
        head = asyncio.ensure_future(self.head.receive())
        tail = asyncio.ensure_future(self.tail.receive())
        done, pending = await asyncio.wait({head, tail}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        assert done, "no answer in 30 s"
        return next(iter(done)).result().message

    def close(self):
        self.head.close()
        self.tail.close()


def server_sessions(servers, session_id):
    return [server.handler.sessions[session_id] for server in servers]


def chain_caches(local_spans, ids):
    """Every span's cache after computing ``ids`` as one chain from scratch."""
    caches, hidden = [], None
    with single_torch_thread():
        for span in local_spans:
            cache = span.new_cache()
            if hidden is None:
                hidden = span.embed(torch.tensor([ids]))
            hidden = span.forward(hidden, None, 0, cache, range(span.start, span.end))
            caches.append(cache)
    return caches


def assert_caches_equal(server_cache, local_cache, length):
    for ours, theirs in zip(server_cache.layers, local_cache.layers, strict=True):
        assert ours.keys.shape[-2] == theirs.keys.shape[-2] == length
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-4, rtol=1e-4)


def greedy_truth(tiny_reference, count):
    out = tiny_reference.generate(torch.tensor(PROMPT), max_new_tokens=count, do_sample=False)
    return out[0, len(PROMPT[0]) :].tolist()


def test_after_a_tree_run_every_cache_equals_the_accepted_chain(tree_servers, local_spans, tiny_reference):
    model, servers = tree_servers
    truth = greedy_truth(tiny_reference, 12)
    prompt = PROMPT[0]

    async def scenario():
        s = Raw(model, servers)
        await s.open()
        first = await s.step(0, prompt)
        assert first.next_token == truth[0]
        # the truth sits down the second branch of the root, then the first of its children
        wrong = [(t + 1) % 1000 for t in truth]
        ids = [wrong[1], truth[1], wrong[2], truth[2], truth[3], wrong[4], wrong[3]]
        parents = [-1, -1, 1, 1, 3, 4, 0]
        result = await s.step(len(prompt), [truth[0]] + ids, n_draft=len(ids), parents=parents)
        assert isinstance(result, StepResult) and result.path == [1, 3, 4] and result.accepted == 3
        assert result.next_token == truth[4]
        base = len(prompt) + 1
        for session in server_sessions(servers, s.session_id):  # the tree is held in run order
            assert len(session.history) == base + len(ids)
        # the next run keeps the path: every server gathers it into a chain, then trims
        after = await s.step(base + 3, [truth[4]], tree_path=result.path)
        assert isinstance(after, StepResult) and after.next_token == truth[5]
        committed = prompt + truth[:5]
        for session, server, local in zip(
            server_sessions(servers, s.session_id), servers, chain_caches(local_spans, committed)
        ):
            assert session.history == committed
            assert_caches_equal(session.cache, local, len(committed))
        # a tree whose accepted path is its run-order chain needs no tree_path
        result = await s.step(len(committed), [truth[5], truth[6], wrong[6]], n_draft=2, parents=[-1, -1])
        assert result.path == [0] and result.next_token == truth[7]
        after = await s.step(len(committed) + 2, [truth[7]])
        committed = committed + truth[5:8]
        assert after.next_token == truth[8]
        for session, local in zip(server_sessions(servers, s.session_id), chain_caches(local_spans, committed)):
            assert session.history == committed
            assert_caches_equal(session.cache, local, len(committed))
        s.close()

    _loop.run(scenario(), timeout=120)


MALFORMED = {  # name -> (step keyword arguments after the prefill, with the tree's ids; the phrase expected)
    "parent out of range": (dict(n_draft=2, parents=[-1, 7]), "parents[1] = 7 is out of range"),
    "parent not before its child": (dict(n_draft=2, parents=[1, -1]), "parents[0] = 1 does not come before its child"),
    "parent is itself": (dict(n_draft=2, parents=[-1, 1]), "parents[1] = 1 does not come before its child"),
    "fewer parents than drafts": (dict(n_draft=2, parents=[-1]), "parents has 1 entries for 2 drafts"),
    "more nodes than the limit": (
        dict(n_draft=MAX_TREE_NODES + 1, parents=[-1] * (MAX_TREE_NODES + 1)),
        f"exceeds the limit of {MAX_TREE_NODES} nodes per run",
    ),
    "with the rejection exchange": (
        dict(
            n_draft=2, parents=[-1, -1], draft_q=pack_f16([0.5, 0.5]), sampling=SamplingParams(do_sample=True, seed=1)
        ),
        "rejection exchange",
    ),
    "tree_path after no tree": (dict(n_draft=0, tree_path=[0]), "which was no tree"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_trees_are_refused_and_the_session_goes_on(tree_servers, tiny_reference, case):
    model, servers = tree_servers
    truth = greedy_truth(tiny_reference, 6)
    prompt = PROMPT[0]
    kwargs, phrase = MALFORMED[case]

    async def scenario():
        s = Raw(model, servers)
        await s.open()
        assert (await s.step(0, prompt)).next_token == truth[0]
        n = kwargs["n_draft"]
        refused = await s.step(len(prompt), [truth[0]] + [(t + 5) % 1000 for t in range(n)], **kwargs)
        assert isinstance(refused, ErrorReply) and refused.code == ErrorCode.BAD_REQUEST, refused
        assert phrase in refused.message, refused.message
        # the same session serves a correct tree next
        wrong = (truth[1] + 1) % 1000
        result = await s.step(len(prompt), [truth[0], wrong, truth[1], truth[2]], n_draft=3, parents=[-1, -1, 1])
        assert isinstance(result, StepResult) and result.path == [1, 2] and result.next_token == truth[3]
        result = await s.step(len(prompt) + 3, [truth[3]], tree_path=[1, 2])
        assert result.next_token == truth[4]
        s.close()

    _loop.run(scenario(), timeout=120)


def test_keeping_tree_nodes_needs_their_path(tree_servers, tiny_reference):
    model, servers = tree_servers
    truth = greedy_truth(tiny_reference, 6)
    prompt = PROMPT[0]

    async def scenario():
        s = Raw(model, servers)
        await s.open()
        await s.step(0, prompt)
        wrong = (truth[1] + 1) % 1000
        tree = dict(n_draft=3, parents=[-1, -1, 1])
        result = await s.step(len(prompt), [truth[0], wrong, truth[1], truth[2]], **tree)
        assert result.path == [1, 2]
        for kwargs, phrase in (
            (dict(), "name the accepted path in tree_path"),
            (dict(tree_path=[0, 2]), "tree_path is no path"),
            (dict(tree_path=[1]), "tree_path names 1"),
        ):
            refused = await s.step(len(prompt) + 3, [truth[3]], **kwargs)
            assert isinstance(refused, ErrorReply) and phrase in refused.message, refused
        result = await s.step(len(prompt) + 3, [truth[3]], tree_path=[1, 2])
        assert result.next_token == truth[4]
        s.close()

    _loop.run(scenario(), timeout=120)


def test_a_refused_tree_run_leaves_the_client_session_usable(tree_servers, monkeypatch):
    """Through the client: a tree the servers refuse ends that call with their clear error; the
    next call in the same inference session generates on correctly."""
    model, servers = tree_servers
    plain = model.generate(torch.tensor(PROMPT), max_new_tokens=16, speculation=None)
    truth = plain[0, len(PROMPT[0]) :].tolist()
    monkeypatch.setattr(
        "client._drafter_choice.make_drafter",
        lambda *a, **k: ScriptedTreeDrafter(truth, len(PROMPT[0]), {1, 3}, 3, {1, 3}),
    )
    import client.modes.tree as tree_mode

    real_build, calls = tree_mode.build_tree, []

    def sometimes_malformed(*args, **kwargs):
        tree = real_build(*args, **kwargs)
        calls.append(len(tree))
        if len(calls) == 3 and len(tree) > 1:
            tree.parents[-1] = len(tree) + 3  # out of range
        return tree

    monkeypatch.setattr(tree_mode, "build_tree", sometimes_malformed)
    with full_trees(monkeypatch):
        with model.inference_session(max_length=160):
            with pytest.raises(GenerationError, match="out of range"):
                model.generate(torch.tensor(PROMPT), max_new_tokens=16, num_draft_tokens=3, draft_tree=True)
            output = model.generate(torch.tensor(PROMPT), max_new_tokens=16, num_draft_tokens=3, draft_tree=True)
    assert output.tolist() == plain.tolist()


class DropSessionAfter:
    """A streamer that closes the client's results stream once: the session is lost mid-generation,
    no server is to blame (all answer pings), and the client fails over onto the same servers,
    replaying the committed tokens."""

    def __init__(self, session, after):
        self.session, self.after, self.seen, self.dropped = session, after, -1, False

    def put(self, tokens):
        self.seen += 1 if self.seen < 0 else len(tokens.view(-1))
        if not self.dropped and self.seen >= self.after:
            self.dropped = True
            self.session.remote._tail.close()

    def end(self):
        pass


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_trees_survive_failover_and_chunked_prefill(tree_servers, monkeypatch, sampling):
    model, servers = tree_servers
    model.swarm.excluded = type(model.swarm.excluded)()  # no exclusion from an earlier test
    kwargs = dict(do_sample=True, temperature=0.8, top_p=0.9, seed=21) if sampling else {}
    prompt = torch.tensor([PROMPT[0] * 3])  # 33 positions: chunks of 12
    plain = model.generate(prompt, max_new_tokens=24, speculation=None, **kwargs)
    truth = plain[0, prompt.shape[1] :].tolist()
    drafter = ScriptedTreeDrafter(truth, prompt.shape[1], {2, 7, 8, 15}, 4, {2, 7, 15})
    monkeypatch.setattr("client._drafter_choice.make_drafter", lambda *a, **k: drafter)
    monkeypatch.setattr(model.swarm, "max_positions_per_step", 12)  # the client chunks, trees stay within 12
    with full_trees(monkeypatch):
        with model.inference_session(max_length=160) as session:
            streamer = DropSessionAfter(session, 9)
            output = model.generate(
                prompt, max_new_tokens=24, num_draft_tokens=4, draft_tree=True, streamer=streamer, **kwargs
            )
    assert output.tolist() == plain.tolist()
    stats = model.last_generation_stats
    assert streamer.dropped and stats.failovers == 1, stats.failover_events
    assert max(stats.tree_sizes) <= 12 - 1 and stats.tree_accepted > 0


def test_tail_drafts_after_a_tree_continue_the_accepted_path(tiny_llama_path, tiny_reference, tmp_path):
    """The tail's drafter drafts after a tree run from the accepted path's hidden states: its
    ids equal those of a fresh head over the committed text, and its cache keeps only that path."""
    from transformers import AutoConfig

    from server.session import QueuedRun, ServerSession
    from server.tail_drafter import build_tail_drafter
    from tests.kit.checkpoints import build_random_drafter

    config = AutoConfig.from_pretrained(tiny_llama_path)
    checkpoint = Checkpoint(str(tiny_llama_path))
    span = load_span(config, checkpoint, 0, config.num_hidden_layers, torch.float32, "cpu")
    span.drafter = build_tail_drafter(
        span, config, checkpoint, build_random_drafter(tiny_llama_path, tmp_path / "head.safetensors"), max_drafts=4
    )
    truth = greedy_truth(tiny_reference, 8)
    prompt = PROMPT[0]
    session = ServerSession("s", 128, [Hop("p", 0, config.num_hidden_layers)], 0, span.new_cache())

    def run(step):
        session.check_step(step, None, span)
        session.accept(step)
        return asyncio.run(through_the_scheduler(span, session, QueuedRun(step, None)))

    def fresh_drafts(committed, next_token):
        cache = span.new_cache()
        hidden = span.forward(span.embed(torch.tensor([committed])), None, 0, cache, range(span.start, span.end))
        return span.drafter.draft(span.drafter.new_session(), hidden, committed, 0, len(committed), next_token, 4)

    with single_torch_thread():
        first = run(Step(session_id="s", run_id=1, start_pos=0, token_ids=prompt, tail_drafts=4))
        assert first.next_token == truth[0] and first.drafts == fresh_drafts(prompt, truth[0])
        wrong = [(t + 1) % 1000 for t in truth]
        ids, parents = [wrong[1], truth[1], wrong[2], truth[2]], [-1, -1, 1, 1]
        tree = run(
            Step(
                session_id="s",
                run_id=2,
                start_pos=len(prompt),
                token_ids=[truth[0]] + ids,
                n_draft=4,
                parents=parents,
                tail_drafts=4,
            )
        )
        assert tree.path == [1, 3] and tree.next_token == truth[3]
        committed = prompt + truth[:3]
        assert tree.drafts == fresh_drafts(committed, truth[3])
        after = run(
            Step(
                session_id="s",
                run_id=3,
                start_pos=len(committed),
                token_ids=[truth[3]],
                tail_drafts=4,
                tree_path=[1, 3],
            )
        )
        assert after.next_token == truth[4] and after.drafts == fresh_drafts(committed + truth[3:4], truth[4])
        assert session.history == committed + truth[3:4]


async def through_the_scheduler(span, session, run):
    """A run's output computed as a server computes it: by the batch scheduler (server/batching.py)."""
    from concurrent.futures import ThreadPoolExecutor

    from server.batching import BatchScheduler

    with ThreadPoolExecutor(1) as executor:
        batches = BatchScheduler(span, executor, gather_window=0)
        batches.start()
        try:
            return await batches.compute(session, run)
        finally:
            batches.stop()


def test_trees_with_the_tails_tail_drafts(tree_servers, tiny_llama_path, tmp_path):
    """speculation="suffix+tail" with trees: the head's ids ride as a branch beside retrieval's."""
    from transformers import AutoConfig

    from server.tail_drafter import build_tail_drafter
    from tests.kit.checkpoints import build_random_drafter

    model, servers = tree_servers
    tail = servers[-1].span
    config = AutoConfig.from_pretrained(tiny_llama_path)
    head = build_random_drafter(tiny_llama_path, tmp_path / "head.safetensors")
    prompt = torch.tensor([PROMPT[0] * 3])
    plain = model.generate(prompt, max_new_tokens=20, speculation=None)
    tail.drafter = build_tail_drafter(tail, config, Checkpoint(str(tiny_llama_path)), head, max_drafts=4)
    try:
        output = model.generate(prompt, max_new_tokens=20, speculation="suffix+tail", draft_tree=True)
    finally:
        tail.drafter = None
    assert output.tolist() == plain.tolist()
    stats = model.last_generation_stats
    assert stats.tree_laps == stats.laps and stats.drafter_sources["tail"][0] > 0


def test_random_trees_get_a_verdict_or_a_clear_refusal(tree_servers, tiny_reference):
    """A small fuzz: random parents, counts and paths; every run gets a verdict or a named
    bad_request, and a correct run afterwards is verified right."""
    import random

    model, servers = tree_servers
    truth = greedy_truth(tiny_reference, 4)
    prompt = PROMPT[0]
    rng = random.Random(16)

    async def scenario():
        s = Raw(model, servers)
        await s.open()
        await s.step(0, prompt)
        outcomes = set()
        for _ in range(40):
            n = rng.randint(1, 9)
            parents = [rng.randint(-2, n + 1) if rng.random() < 0.15 else rng.randint(-1, j - 1) for j in range(n)]
            parents = parents[: n + rng.choice([0, 0, 0, -1, 1])] if rng.random() < 0.2 else parents
            tree_path = [rng.randint(-1, 8) for _ in range(rng.randint(0, 3))] if rng.random() < 0.3 else []
            ids = [truth[0]] + [rng.choice([truth[1], truth[2], 5, 77]) for _ in range(n)]
            reply = await s.step(len(prompt), ids, n_draft=n, parents=parents, tree_path=tree_path)
            if isinstance(reply, ErrorReply):
                assert reply.code == ErrorCode.BAD_REQUEST and reply.message, reply
                outcomes.add("refused")
            else:  # a tree (or a chain, where parents came out empty): the target's own tokens
                accepted = [ids[1 + n] for n in reply.path] if parents else ids[1 : 1 + reply.accepted]
                assert accepted + [reply.next_token] == truth[1 : 2 + reply.accepted], reply
                outcomes.add("verdict")
        assert outcomes == {"refused", "verdict"}
        result = await s.step(len(prompt), [truth[0], 5, truth[1]], n_draft=2, parents=[-1, -1])
        assert result.path == [1] and result.next_token == truth[2]
        s.close()

    _loop.run(scenario(), timeout=120)


@pytest.mark.parametrize(
    "mode",
    [
        dict(draft_tree=True),
        dict(async_speculation=True),
        dict(do_sample=True, temperature=0.8, top_p=0.9, seed=5),
        dict(do_sample=True, temperature=0.8, seed=5, draft_tree=True),
    ],
    ids=["tree", "async", "seeded", "seeded tree"],
)
def test_spot_checks_at_every_verdict_find_no_divergence_on_honest_servers(tiny_model, tiny_reference, mode):
    """Every verdict spot-checked, and each replay compared with the live lap it replays
    (client/_live_agreement.py), in the modes whose laps the audits record differently: tree laps are not
    recorded (the replay's drafts are then the last committed ids, which at the first lap reach back into
    the prompt: read as a divergence before that was excluded), async runs, seeded sampling. Honest servers:
    no divergence, no dispute, the tokens of a run without spot-checks (greedy: transformers')."""
    prompt = torch.tensor([PROMPT[0] * 3])
    kwargs = dict(max_new_tokens=24, speculation="suffix", draft_lap_costs=(0.05, 0.002), **mode)
    with pinned(tiny_model, ROUTES["two servers"]):
        tiny_model.reset_draft_store()
        expected = tiny_model.generate(prompt, spot_check_rate=0, **kwargs).tolist()
        if not mode.get("do_sample"):
            assert expected == tiny_reference.generate(prompt, max_new_tokens=24, do_sample=False).tolist()
        tiny_model.reset_draft_store()
        output = tiny_model.generate(prompt, spot_check_rate=1.0, **kwargs).tolist()
        stats = tiny_model.last_generation_stats
    assert output == expected
    assert stats.spot_checks >= 3 and stats.spot_checks_diverged == 0, stats.spot_check_events
    assert stats.spot_checks_undecided == 0 and stats.disputed_peers == [], stats.spot_check_events
