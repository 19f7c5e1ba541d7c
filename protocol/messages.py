"""The wire: every message that crosses a process boundary, and its encoding.

One lap (docs/design.md, "One lap"): the client sends a :class:`Step` of token ids to the head; each
server runs its blocks and pushes the same :class:`Step` plus activations to the next server on
the session's ordered stream; the tail verifies and sends a :class:`StepResult` on the stream
the client opened to it with :class:`Subscribe`. :class:`Cancel` and :class:`CloseSession`
follow the same ordered path as the data, so they never overtake what they cancel. A forward
pass asks for full logits with ``Step.return_logits``; the tail sends them in :class:`RunOutputs`
messages on the results stream, before the run's StepResult.

Messages are msgspec structs encoded as MessagePack inside hivemind's protobuf envelope
(``ExpertRequest.metadata``); activations travel beside them in ``ExpertRequest.tensors``.
Each encoded message starts with the protocol version, checked before anything else is read.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional, Union

import msgspec

from protocol.errors import ErrorCode, ProtocolError
from protocol.limits import MAX_NUM_LABELS, MAX_STOP_TOKEN_IDS, MAX_TRAIN_SPARES, MAX_TRAIN_STEPS_IN_FLIGHT
from protocol.tail_costs import TailCosts
from protocol.version import PROTOCOL_VERSION

# A session id is the opener's random token (the client draws 16 hex digits): longer ones are
# malformed, so no peer makes a server store, key or log an id of its choosing length
MAX_SESSION_ID_CHARS = 64
SessionId = Annotated[str, msgspec.Meta(max_length=MAX_SESSION_ID_CHARS)]

_SAMPLING_KEYS = dict(
    do_sample="d",
    temperature="t",
    top_k="k",
    top_p="p",
    min_p="m",
    repetition_penalty="r",
    seed="s",
    constraint="c",
    output_start="o",
    presence_penalty="e",
    frequency_penalty="f",
    logit_bias="b",
)

# A constraint's text (a JSON schema, a regex, an EBNF grammar) is at most this many characters: it
# travels once per session (with the sampling parameters) and the tail compiles it, so it is bounded
# like every other field a peer sends (a 16 KiB JSON schema is a large one: OpenAI caps a schema's
# properties at 5000 characters of names and enums together)
MAX_CONSTRAINT_CHARS = 16384
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar")
MAX_LOGIT_BIAS = 300  # biased ids per request (OpenAI's limit)


class Constraint(msgspec.Struct, frozen=True, array_like=True):
    """What the tail's choices must match from ``SamplingParams.output_start`` on (docs/design.md,
    "Constraints at the tail"; compiled by protocol/constraints.py): ``kind`` one of CONSTRAINT_KINDS,
    ``spec`` its text (JSON schema, regex, EBNF in xgrammar's dialect; empty for json_object);
    ``stop_token_ids`` (v9): ids besides EOS that end the output, stops of the matcher as of the client."""

    kind: Annotated[str, msgspec.Meta(max_length=16)]
    spec: Annotated[str, msgspec.Meta(max_length=MAX_CONSTRAINT_CHARS)] = ""
    stop_token_ids: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_STOP_TOKEN_IDS)] = ()


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, rename=_SAMPLING_KEYS):
    """How the tail chooses a token; transformers' argument names and meanings.

    On the wire a map of one-letter keys without the defaults (msgspec writes every field of an
    array_like struct, and a float is 9 bytes): top-k sampling with a seed is 14 bytes, not 37."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    constraint: Optional[Constraint] = None  # structured output: the tail masks its choices with it
    # the absolute position of the first generated token (the prompt's length): the constraint and
    # the presence/frequency penalties apply to the tokens from here on (the prompt is not matched or counted)
    output_start: Annotated[int, msgspec.Meta(ge=0)] = 0
    presence_penalty: float = 0.0  # OpenAI's: minus this from an id's logit once it occurs in the output
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the id's count in the output
    logit_bias: Annotated[dict[int, float], msgspec.Meta(max_length=MAX_LOGIT_BIAS)] = {}  # id -> added to its logit


GREEDY = SamplingParams()
"""The default parameters: argmax decoding. A Step carries ``sampling=None`` for these."""


class Hop(msgspec.Struct, frozen=True, array_like=True):
    """One server of a route and the blocks [start, end) it computes for this session."""

    peer_id: str
    start: int
    end: int
    # circuit addresses of a server behind NAT (protocol.relay), so the hop before it can dial it
    addrs: Annotated[list[Annotated[str, msgspec.Meta(max_length=512)]], msgspec.Meta(max_length=4)] = []


class OpenSession(msgspec.Struct, tag="open", kw_only=True, array_like=True):
    session_id: SessionId
    max_length: int  # positions the session may ever hold; reserved in every server's cache
    route: list[Hop]  # the whole chain, head first
    hop_index: int  # which hop of ``route`` the receiver is
    # sha256 (hex) of a secret only the client knows: the tail sends results only to a Subscribe
    # that carries the secret, so route servers, which see this hash, cannot subscribe themselves
    secret_hash: str = ""
    # prompt tuning (docs/fine_tuning.md): the head computes the session's first ``num_prompts`` positions
    # from the prompt embeddings sent with this message (one tensor ``[num_prompts, hidden]`` float32,
    # to the head only) instead of embedding their ids; 0: none
    num_prompts: int = 0
    # deep prompt tuning (v8): the message's last tensor is ``[num_blocks - hop.start, num_prompts, hidden]``
    # float32, the prompts each block from the receiver's first on adds to the prompt positions of its input;
    # each server keeps its span's rows and relays the rest (server/deep_prompts.py)
    deep_prompts: bool = False
    # a LoRA adapter (a name the server announces in ServerInfo.adapters) every hop applies to this session's
    # blocks; "": none. An adapter a hop does not serve is refused (unknown_adapter)
    active_adapter: Annotated[str, msgspec.Meta(max_length=256)] = ""


class Step(msgspec.Struct, tag="step", kw_only=True, array_like=True, omit_defaults=True):
    """One speculative run: ``token_ids`` start at absolute position ``start_pos``.

    The first ``len(token_ids) - n_draft`` ids are committed tokens not yet in the caches
    (usually one: the last bonus token); the last ``n_draft`` are drafts to verify, a chain, or a
    tree when ``parents`` is set (protocol/trees.py).
    ``start_pos`` is also the rollback: every server trims its cache to it first.

    On the wire an array that stops at the last field not at its default (:func:`encode`), so the optional
    fields at the end (trees, looped runs) cost a plain chain lap nothing: new fields go last, the rarest last.
    """

    session_id: SessionId
    run_id: int
    start_pos: int
    token_ids: list[int]
    n_draft: int = 0
    sampling: Optional[SamplingParams] = None  # None: greedy; not on the wire (half a greedy lap's bytes)
    top_logprobs: int = 0  # K <= MAX_TOP_LOGPROBS; 0 sends nothing but ids and counts down
    # the tail also returns the full float32 logits of the run's last ``return_logits`` positions
    # (0: none), in RunOutputs messages sent before the StepResult; ``return_hidden`` adds the
    # final hidden state (after the final norm) of the same positions. For forward passes.
    return_logits: int = 0
    return_hidden: bool = False
    # the rejection (DSSD) exchange: q(x) of each draft under the client's draft model, float16
    # little-endian, 2 bytes per draft (exactly n_draft of them); present, it asks the tail to accept
    # draft i with probability min(1, p/q) instead of by token match (protocol/sampling.py)
    draft_q: Optional[bytes] = None
    # ask the tail's drafter for up to this many ids after the verdict (StepResult.drafts);
    # 0: none (a tail without a head sends none either way)
    tail_drafts: int = 0
    # looped runs (docs/protocol.md, "Looped runs"): after this run's verdict the tail may start the
    # next run at the head itself (LoopedRun), with the verdict's next token and drafts, carrying
    # loop_runs - 1. 0: the client sends every run
    loop_runs: int = 0
    # token trees (docs/protocol.md, "Token trees"): one entry per draft, the index of its parent
    # among the run's drafts, or -1 for the run's last committed id; a parent comes before its
    # child. Empty: the drafts are a chain. At most protocol.limits.MAX_TREE_NODES drafts
    parents: list[int] = []
    # the accepted path (draft indices, root first) of the session's previous run, when that run was a
    # tree and this Step keeps some of its nodes (start_pos beyond the tree's first draft position):
    # every server gathers those cache entries into a chain, then trims to start_pos. Not needed when
    # the kept nodes are the tree's first ones in run order and already a chain
    tree_path: list[int] = []
    hidden_at: int = -1  # with return_hidden, the state entering this block of the tail's span (client/_bisection.py)

    @property
    def sampling_params(self) -> SamplingParams:
        return GREEDY if self.sampling is None else self.sampling


class Cancel(msgspec.Struct, tag="cancel", kw_only=True, array_like=True):
    """Drop run ``run_id`` and every later run of the session."""

    session_id: SessionId
    run_id: int


class CloseSession(msgspec.Struct, tag="close", kw_only=True, array_like=True):
    session_id: SessionId


class Subscribe(msgspec.Struct, tag="subscribe", kw_only=True, array_like=True):
    """Sent by the client to the tail: results of this session go back on this stream.

    ``secret``: the client's session secret; the tail compares its sha256 with the session's
    ``OpenSession.secret_hash`` and refuses (``unauthorized``) anyone who does not know it."""

    session_id: SessionId
    secret: str = ""


class SessionOpened(msgspec.Struct, tag="opened", kw_only=True, array_like=True):
    session_id: SessionId


class TokenLogprobs(msgspec.Struct, array_like=True):
    """The model's log-probabilities at one generated position (raw logits, no processing)."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class StepResult(msgspec.Struct, tag="result", kw_only=True, array_like=True, omit_defaults=True):
    """The tail's verdict on one run, sent to the client (and, in a looped run, what the tail
    builds the next run from). An array that stops at its last non-default field, as Step."""

    session_id: SessionId
    run_id: int
    accepted: int  # drafts accepted: a prefix of a chain's drafts, or the length of a tree's ``path``
    next_token: int  # the target's own token after the accepted drafts
    # protocol.digest.step_digest of the Step the tail verified, keyed with the session's secret:
    # the client compares it with its own, so a hop that rewrote the Step is caught at once. Every
    # verdict carries it, so it comes before the optional fields (which would cost it their defaults)
    step_digest: int = 0
    logprobs: Optional[list[TokenLogprobs]] = None  # accepted + 1 entries when asked for
    # the rejection exchange, on a rejected draft only: the top-K ids of the target's processed p at
    # the rejected position and their probabilities (float16 little-endian, 2 bytes each); the
    # client samples the token there from norm(max(0, p - q)) over them, instead of next_token
    correction_ids: Optional[list[int]] = None
    correction_p: Optional[bytes] = None
    # ids drafted by the tail's drafter after next_token (Step.tail_drafts asked for them):
    # only drafts, which the client may send in its next run like its own
    drafts: list[int] = []
    # looped runs: the tail has started run run_id + 1 at the head, from the position after
    # next_token's, with next_token and drafts (or the client's DraftOffer for this verdict)
    looped: bool = False
    # on the verdict of a looped run: the drafts it carried, which the client did not choose
    run_drafts: Optional[list[int]] = None
    # on the verdict of a tree run (a Step with parents): the accepted path, draft indices from the
    # root down (``accepted`` is its length). Empty for a chain
    path: list[int] = []
    # v9: what verifying this run cost the tail (TailCosts); None from a tail that does not measure
    tail_costs: Optional[TailCosts] = None


class LoopedRun(msgspec.Struct, tag="loop", kw_only=True, array_like=True, omit_defaults=True):
    """Tail -> head, on a session stream of its own: the next run of a session whose Step asked for
    ``loop_runs``, built from the verdict the tail has just sent to the client. The head takes it
    only from the route's tail, and only if the run it follows is still the session's last and no
    cancel has arrived since (else the client has already moved on: it is dropped). ``accepted`` is
    the verdict's count on the run it follows: with ``step.token_ids[0]`` it names the verdict, for
    which the client may have offered drafts (DraftOffer) that then replace the tail's."""

    step: Step  # the run, with loop_runs one less than the run before it
    accepted: int


class DraftOffer(msgspec.Struct, tag="offer", kw_only=True, array_like=True):
    """Client -> head, while run ``run_id`` is in flight with looped runs on: the client's drafts
    for the run the tail will start after it, one option per verdict it finds likely, as
    ``(accepted, next_token, drafts)``. The head uses the option matching the verdict, if any, in
    place of the tail's drafts; the client's retrieval drafts so ride in looped runs."""

    session_id: SessionId
    run_id: int
    options: list[tuple[int, int, list[int]]]


class RunOutputs(msgspec.Struct, tag="outputs", kw_only=True, array_like=True):
    """Tail -> client, before the run's StepResult: rows ``offset .. offset + n`` of the outputs a
    Step asked for with ``return_logits`` (row 0 is the first of its last ``return_logits``
    positions). Tensors: logits ``[n, vocab]`` float32, then, with ``return_hidden``, the final
    hidden states ``[n, hidden]`` float32. The tail splits the rows over as many messages as keep
    each frame under ``OUTPUTS_FRAME_BYTES``."""

    session_id: SessionId
    run_id: int
    offset: int


class TrainForward(msgspec.Struct, tag="train", kw_only=True, array_like=True):
    """One row of a training step, client -> head -> ... -> tail on the training protocol (docs/design.md,
    "Fine-tuning"). The head's input is ``num_prompts`` prompt embeddings (its one tensor, ``[num_prompts,
    hidden]`` float32) followed by the embeddings of ``token_ids``; past the head the tensor is the previous
    span's output ``[num_prompts + len(token_ids), hidden]``. ``targets``: per id, the token its logits are
    scored against (-100: none); the tail's loss is the sum of their cross-entropies."""

    step_id: SessionId
    route: list[Hop]
    hop_index: int
    num_prompts: int
    token_ids: list[int]
    targets: list[int]
    # deep prompt tuning (v8; docs/fine_tuning.md): a second tensor ``[num_blocks - hop.start, num_prompts,
    # hidden]`` float32, the prompts each block from the receiver's first to the model's last adds to the
    # prompt positions of its input; each hop uses its span's rows and sends the rest on
    deep_prompts: bool = False
    # sequence classification (v8): the tail scores the final (normed) hidden state of the row's last
    # position with the ``[num_labels, hidden]`` float32 weights of the message's last tensor (relayed hop by
    # hop) against ``label`` (a class index; a real value when num_labels is 1: regression) instead of the LM
    # head against ``targets`` (then all -100); 0: the causal LM loss
    num_labels: int = 0
    label: float = 0.0
    active_adapter: Annotated[str, msgspec.Meta(max_length=256)] = ""  # as OpenSession.active_adapter
    # multi-label classification (v9): one target in [0, 1] per label (num_labels of them; ``label`` unused);
    # the tail's loss is their mean binary cross-entropy with logits (transformers' multi_label_classification)
    multi_labels: Annotated[list[float], msgspec.Meta(max_length=MAX_NUM_LABELS)] = []
    # a row longer than the route's step limit, in chunks (v9; docs/design.md, "Long rows in chunks"): one lap
    # per chunk under the same ``step_id``, forward laps 0..num_chunks-1 in order (each hop keeps the chunk's
    # input and its keys/values; the last lap also runs that chunk's backward), then backward laps
    # (``backward_only``, no tensors, the chunk's ids and targets again) num_chunks-2..0. ``chunk_offset``: the
    # row's positions before this chunk (prompts included); the prompts are in chunk 0 only
    chunk_index: int = 0
    num_chunks: int = 1
    chunk_offset: int = 0
    backward_only: bool = False
    # single-span replacement (v9; server/train_replay.py): servers the client offers as replacements, each for
    # exactly one hop's blocks; a hop whose next hop fails sends its output again to the first spare of those blocks
    spares: Annotated[list[Hop], msgspec.Meta(max_length=MAX_TRAIN_SPARES)] = []


class TrainBackward(msgspec.Struct, tag="backward", kw_only=True, array_like=True):
    """The reply to a TrainForward on its stream, tail -> ... -> head -> client: the gradient of the
    receiver's span output (``[positions, hidden]`` float32; to the client only the prompts' rows), with
    the tail's loss (sum of the row's target cross-entropies) and how many targets it counted. With
    ``TrainForward.deep_prompts`` a second tensor: the gradient of the deep prompts the receiver sent
    (``[num_blocks - hop.start, num_prompts, hidden]``; the client gets all ``num_blocks`` of them). With
    ``TrainForward.num_labels`` a last tensor: the final hidden state the tail scored, ``[1, hidden]``."""

    step_id: SessionId
    loss_sum: float
    num_targets: int


class TrainDrop(msgspec.Struct, tag="train_drop", kw_only=True, array_like=True):
    step_ids: Annotated[list[SessionId], msgspec.Meta(max_length=MAX_TRAIN_STEPS_IN_FLIGHT)]  # abandoned steps (v9)
    route: list[Hop]  # client -> route[0] -> ...: each hop forgets their rows now, tells the next, answers in kind


class ErrorReply(msgspec.Struct, tag="error", kw_only=True, array_like=True):
    session_id: SessionId
    code: ErrorCode
    message: str
    run_id: Optional[int] = None
    peer_id: str = ""  # the server that found the error


class Ping(msgspec.Struct, tag="ping", array_like=True):
    """Liveness and RTT probe; answered at once with a Pong carrying the same nonce."""

    nonce: int


class Pong(msgspec.Struct, tag="pong", array_like=True):
    nonce: int
    open_sessions: int = 0


Message = Union[
    OpenSession,
    Step,
    LoopedRun,
    DraftOffer,
    Cancel,
    CloseSession,
    Subscribe,
    SessionOpened,
    StepResult,
    RunOutputs,
    TrainForward,
    TrainBackward,
    TrainDrop,
    ErrorReply,
    Ping,
    Pong,
]

MAX_TOP_LOGPROBS = 20
OUTPUTS_FRAME_BYTES = 64 * 1024 * 1024  # the tensors of one RunOutputs message stay under this


class _Envelope(msgspec.Struct, array_like=True):
    version: int
    message: Message


class _Header(msgspec.Struct, array_like=True):
    version: int


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Envelope)
_header_decoder = msgspec.msgpack.Decoder(_Header)


def encode(message: Message) -> bytes:
    return _encoder.encode((PROTOCOL_VERSION, _trimmed(message)))


def _trimmed(message: msgspec.Struct) -> Any:
    """An ``array_like, omit_defaults`` message as the array msgspec would write, cut after its last
    field that is not at its default (nested such messages likewise); any other message as is.

    msgspec writes every field of an array_like struct, ``omit_defaults`` or not (msgspec issue
    #720), but it decodes a shorter array by filling the missing fields with their defaults: so
    a Step or StepResult may grow optional fields at its end without a plain chain lap paying for them.
    """
    config = message.__struct_config__
    if not (config.array_like and config.omit_defaults):
        return message
    values = [getattr(message, name) for name in message.__struct_fields__]
    defaults = _trailing_defaults(type(message))
    end = len(values)
    first_default = end - len(defaults)
    while end > first_default and values[end - 1] == defaults[end - 1 - first_default]:
        end -= 1
    values = [_trimmed(v) if isinstance(v, msgspec.Struct) else v for v in values[:end]]
    return [config.tag, *values] if config.tag is not None else values


_DEFAULTS: dict[type, tuple] = {}


def _trailing_defaults(kind: type) -> tuple:
    """The default of each field that has one (they are the last fields: kw_only structs keep order)."""
    if kind not in _DEFAULTS:
        fields = msgspec.structs.fields(kind)
        defaults = [
            f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
            for f in fields
            if f.default is not msgspec.NODEFAULT or f.default_factory is not msgspec.NODEFAULT
        ]
        trimmable = fields[len(fields) - len(defaults) :]
        if any(f.default is msgspec.NODEFAULT and f.default_factory is msgspec.NODEFAULT for f in trimmable):
            raise TypeError(f"{kind.__name__}: fields with defaults must come after those without, to be trimmed")
        _DEFAULTS[kind] = tuple(defaults)
    return _DEFAULTS[kind]


def decode(data: bytes) -> Message:
    """Decode one message; a wrong version or malformed bytes raise :class:`ProtocolError`."""
    try:
        version = _header_decoder.decode(data).version
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(ErrorCode.MALFORMED, f"undecodable message: {e}") from None
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.VERSION_MISMATCH,
            f"peer speaks specswarm protocol v{version}, this peer speaks v{PROTOCOL_VERSION}",
        )
    try:
        return _decoder.decode(data).message
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise ProtocolError(ErrorCode.MALFORMED, f"malformed message: {e}") from None
