"""What a server admits, as pure checks: each takes what it needs as arguments and raises a
ProtocolError naming the problem (or returns its decision), with no handler state.

The handler (server/handler.py) calls them as a request arrives, so a stranger's request is refused
before it changes anything here; being pure, each has unit tests of its own (tests/server/test_admission.py).
Every peer is a stranger (docs/reliability.md, "Resource bounds"): an OpenSession must name this
server at the right hop of a sane route, come from the route's previous hop, and fit the caps on
sessions and cache tokens; a Step must fit one frame and the session's queue; a Subscribe must carry
the secret the session was opened with.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence, Union

import torch

from protocol import limits
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import DraftOffer, Hop, OpenSession, Step, Subscribe, TrainForward
from protocol.records import ServerInfo, ServerState
from server.session import ServerSession, check_token_ids


@dataclass(frozen=True)
class HeldBlocks:
    """The blocks this server holds, [start, end) of a model of ``num_blocks`` blocks."""

    start: int
    end: int
    num_blocks: int


@dataclass(frozen=True)
class SessionCaps:
    """The caps on open sessions (the handler's settings, read when a session opens)."""

    max_sessions: int
    max_session_tokens: int
    max_sessions_per_peer: int
    max_peer_tokens: int
    total_tokens: int  # the cache budget, named in refusals


def check_route(message: OpenSession, peer_id: str, held: HeldBlocks, accepting: bool) -> None:
    """The route names this server at ``hop_index``, over blocks it holds, from block 0 to the last
    in contiguous hops; max_length and secret_hash are well formed; the server takes sessions."""
    route, index = message.route, message.hop_index
    if not 0 <= index < len(route) or route[index].peer_id != peer_id:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"hop {index} of the route is not this server ({peer_id})")
    _check_hop(route, index, held)
    if message.max_length <= 0:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"max_length must be positive, got {message.max_length}")
    if not is_sha256_hex(message.secret_hash):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, "secret_hash must be the sha256 (64 hex digits) of the client's secret"
        )
    if not accepting:
        raise ProtocolError(ErrorCode.SHUTTING_DOWN, "this server is shutting down")


def check_hop(route: list[Hop], index: int, peer_id: str, held: HeldBlocks) -> None:
    """Hop ``index`` of ``route`` is this server, over blocks it holds, in a whole and contiguous route
    (a training step's route: server/train_checks.py)."""
    if not 0 <= index < len(route) or route[index].peer_id != peer_id:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"hop {index} of the route is not this server ({peer_id})")
    _check_hop(route, index, held)


def _check_hop(route: list[Hop], index: int, held: HeldBlocks) -> None:
    """This server's hop asks for blocks it holds, and the route runs whole and contiguous."""
    hop = route[index]
    if not held.start <= hop.start < hop.end <= held.end:
        raise ProtocolError(
            ErrorCode.WRONG_BLOCKS, f"blocks {hop.start}:{hop.end} asked, this server holds {held.start}:{held.end}"
        )
    if (index == 0) != (hop.start == 0) or (index == len(route) - 1) != (hop.end == held.num_blocks):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "the route must start at block 0 and end at the last block")
    if index > 0 and route[index - 1].end != hop.start:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "the route's hops are not contiguous")


def check_upstream(message: Union[OpenSession, TrainForward], upstream_peer: str) -> None:
    """Past the head, the stream must come from the route's previous hop (libp2p authenticates
    the peer id), so no peer can enter a chain in the middle or dodge the per-client cap."""
    if message.hop_index > 0:
        previous = message.route[message.hop_index - 1].peer_id
        if upstream_peer != previous:
            raise ProtocolError(
                ErrorCode.UNAUTHORIZED,
                f"hop {message.hop_index} must be opened by the route's previous hop {previous}, not by "
                f"{upstream_peer}",
            )


def check_new_session_id(session_id: str, open_ids: Iterable[str]) -> None:
    """One session id is open once per server (the same id on another stream is refused)."""
    if session_id in open_ids:
        raise ProtocolError(ErrorCode.SESSION_EXISTS, f"session {session_id} is already open here")


def cap_owner(message: OpenSession, upstream_peer: str, known_servers: Mapping[str, ServerInfo]) -> Optional[str]:
    """Whom a new session counts against in the per-peer caps: its upstream peer, unless that
    peer is a server forwarding the session (None: then only the server-wide caps apply).

    A middle hop's upstream is the previous server, which carries many clients' sessions: capping
    it as one client would cap every server pair. It counts as a server only if it is announced
    ONLINE for this model, holding the route's previous hop, in the records this server reads
    (``known_servers``). Why that cannot be abused: every client enters a chain at its head, which
    caps it as a client, and :func:`check_upstream` lets only the route's previous hop open a middle
    session; a stranger who wants to skip the per-peer caps must announce itself as a server of
    the previous blocks (then clients are routed to it and audits check it), and even so its
    sessions stay under the server-wide caps (max_sessions, the cache budget), each under
    max_session_tokens, and its unread results under their byte bounds."""
    if message.hop_index == 0:
        return upstream_peer
    previous = message.route[message.hop_index - 1]
    record = known_servers.get(upstream_peer)
    if (
        record is not None
        and record.state == ServerState.ONLINE
        and record.start_block <= previous.start
        and previous.end <= record.end_block
    ):
        return None
    return upstream_peer


def check_session_caps(
    message: OpenSession, owner: Optional[str], held_sessions: int, owner_holds: tuple[int, int], caps: SessionCaps
) -> None:
    """Open sessions are capped per server; per owner (a client, or a peer not announced as the
    previous server) in sessions and in cache tokens (a share of the budget); and each session's
    max_length by max_session_tokens: one peer cannot take every slot or the whole cache.
    ``owner_holds``: the owner's (sessions, reserved tokens) here; unread when ``owner`` is None."""
    if held_sessions >= caps.max_sessions:
        raise ProtocolError(ErrorCode.BUSY, f"this server has {held_sessions} sessions open, its limit")
    if message.max_length > caps.max_session_tokens:
        raise ProtocolError(
            ErrorCode.BUSY,
            f"no cache room for max_length={message.max_length} in one session: this server's "
            f"max_session_tokens is {caps.max_session_tokens} (announced in its record)",
        )
    if owner is None:
        return
    sessions, tokens = owner_holds
    if sessions >= caps.max_sessions_per_peer:
        raise ProtocolError(
            ErrorCode.BUSY,
            f"peer {owner} already has {sessions} sessions open here (at most {caps.max_sessions_per_peer})",
        )
    if tokens + message.max_length > caps.max_peer_tokens:
        raise ProtocolError(
            ErrorCode.BUSY,
            f"peer {owner} already reserves {tokens} cache tokens here: {message.max_length} more exceed its "
            f"share of {caps.max_peer_tokens} of {caps.total_tokens}",
        )


def check_step_frame(step: Step, num_tensors: int, queued: int, max_positions_per_step: int) -> None:
    """A Step fits this server's positions per Step, its session's run queue, and carries at most
    one tensor (its activations); what it asks of the session is checked by ServerSession.check_step."""
    if len(step.token_ids) > max_positions_per_step:
        raise ProtocolError(
            ErrorCode.STEP_TOO_LARGE,
            f"a Step of {len(step.token_ids)} positions exceeds this server's max_positions_per_step "
            f"{max_positions_per_step}: send long prompts as several Steps (chunked prefill)",
        )
    if queued >= limits.MAX_QUEUED_RUNS:
        raise ProtocolError(ErrorCode.QUEUE_FULL, f"{queued} runs already queued (at most {limits.MAX_QUEUED_RUNS})")
    if num_tensors > 1:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"a Step carries at most one tensor, got {num_tensors}")


def check_offer(offer: DraftOffer, hop_index: int, vocab_size: int) -> None:
    """A DraftOffer goes to the head, with at most MAX_OFFER_OPTIONS options of at most
    MAX_OFFER_DRAFTS drafts each, all in the vocabulary."""
    if hop_index != 0:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a DraftOffer goes to the route's head")
    if len(offer.options) > limits.MAX_OFFER_OPTIONS:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{len(offer.options)} options exceed {limits.MAX_OFFER_OPTIONS}")
    for accepted, next_token, drafts in offer.options:
        if not 0 <= accepted <= limits.MAX_OFFER_DRAFTS or len(drafts) > limits.MAX_OFFER_DRAFTS:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"an option may name and carry at most {limits.MAX_OFFER_DRAFTS} drafts"
            )
        check_token_ids((next_token, *drafts), vocab_size)


def check_looped_sender(session: Optional[ServerSession], step: Step, tail_peer: str) -> None:
    """A looped run reaches the head of an open session of two or more hops, from the route's tail,
    and only when the run before it asked for one more (docs/protocol.md, "Looped runs")."""
    if (
        session is None
        or session.closed
        or session.hop_index != 0
        or len(session.route) < 2
        or tail_peer != session.route[-1].peer_id
    ):
        raise ProtocolError(ErrorCode.UNKNOWN_SESSION, f"no session {step.session_id!r} here whose tail is {tail_peer}")
    if session.loop_runs_left < 1 or step.loop_runs != session.loop_runs_left - 1:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"session {step.session_id!r} asked for no looped run here")


def subscribe_slot_refusal(
    peer: str, pending: Mapping[str, int], max_sessions: int, max_per_peer: int
) -> Optional[str]:
    """Why a Subscribe may not wait for its session here (``pending``: peer -> its Subscribes waiting
    now), or None if it may: at most ``max_sessions`` wait at once, ``max_per_peer`` per peer."""
    total, mine = sum(pending.values()), pending.get(peer, 0)
    if total >= max_sessions or mine >= max_per_peer:
        return (
            f"{total} Subscribes already wait for their sessions here, {mine} of them from peer {peer} "
            f"(at most {max_sessions}, {max_per_peer} per peer)"
        )
    return None


def check_subscriber(session: ServerSession, subscribe: Subscribe) -> Optional[str]:
    """Why this Subscribe may not have the session's results, or None if it may: only the tail sends
    results, only to the holder of the secret whose sha256 opened the session, on one stream."""
    if session.next_hop is not None:
        return "this server is not the session's tail"
    given = hashlib.sha256(subscribe.secret.encode()).hexdigest()
    if not hmac.compare_digest(given, session.secret_hash):
        return "the session's secret does not match: results go only to the client that opened the session"
    if session.subscribed:
        return "the session already has a results stream"
    return None


def is_sha256_hex(text: str) -> bool:
    """A sha256 digest as lowercase hex: what an OpenSession's secret_hash must be."""
    return len(text) == 64 and all(c in "0123456789abcdef" for c in text)


def check_prompts(
    message: OpenSession, tensors: Sequence[torch.Tensor], hidden_shape: Sequence[int], max_positions: int
) -> Optional[torch.Tensor]:
    """The prompt embeddings an OpenSession brings the head (docs/fine_tuning.md), checked: at most
    MAX_PROMPT_POSITIONS (and a Step's positions), within max_length, one float32 ``[num_prompts, hidden]``
    tensor of finite values; none past the head or without num_prompts."""
    count = message.num_prompts
    if count == 0 or message.hop_index > 0:
        if tensors:
            why = "an OpenSession carries a tensor only to the head, with num_prompts"
            raise ProtocolError(ErrorCode.BAD_REQUEST, why)
        return None
    bound = min(limits.MAX_PROMPT_POSITIONS, max_positions, message.max_length)
    if not 0 < count <= bound:
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"num_prompts must be in 0..{bound} (and within max_length), got {count}"
        )
    check_tensors(tensors, count, math.prod(hidden_shape), "the prompt embeddings")
    return tensors[0]


def check_tensors(
    tensors: Sequence[torch.Tensor], rows: int, hidden_size: int, what: str, optional: bool = False
) -> None:
    """Exactly one float32 tensor ``[rows, hidden_size]`` of finite values (none at all when ``optional``
    and ``rows`` is 0)."""
    if optional and not tensors:
        return
    if len(tensors) != 1:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"expected one tensor ({what}), got {len(tensors)}")
    tensor = tensors[0]
    if tuple(tensor.shape) != (rows, hidden_size):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"{what} must have shape {(rows, hidden_size)}, got {tuple(tensor.shape)}"
        )
    if tensor.dtype != torch.float32:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{what} must be float32, got {tensor.dtype}")
    if not bool(torch.isfinite(tensor).all()):
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{what} hold values that are not finite")
