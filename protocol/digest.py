"""The digest a verdict carries of the Step it verified (docs/design.md, "Trust").

Every hop forwards the Step it received, so a middle hop could rewrite it (a draft, the committed
id, the sampling parameters, how many outputs or log-probs it asks, whether the tail loops the next
run, which block boundary a bisection reads) and the tail would answer the altered run honestly; the
client would then take a verdict about another Step for one about its own. The tail therefore puts a
digest of what it verified into ``StepResult.step_digest``, and the client compares it with the
digest of what it sent. The digest is keyed with the session's secret, which only the client and the
tail know (the client proves it to the tail in Subscribe; route servers see only its sha256), so no
hop can compute a matching digest for a Step it rewrote: 32 bits make a blind guess pass once in 4
billion, for 5 bytes per verdict.

Every field of :class:`Step` is bound (v10; v6 to v9 bound ids, positions, drafts and sampling only):
the digest walks the Step's own field list, so a field added later is bound without anyone
remembering to add it. Only the fields in :data:`NOT_DIGESTED` are left out, each with its reason;
``sampling`` is bound as the parameters in effect (a Step without them means "as before").
A field at its default is left out of the digested pairs, as the wire cuts trailing defaults: a new
field that a Step leaves at its default changes no digest, so peers of one version with and without
it still agree on every Step that does not use it.
"""

from __future__ import annotations

import hashlib
import hmac

import msgspec

from protocol.messages import GREEDY, Constraint, SamplingParams, Step

DIGEST_BYTES = 4

# Step fields the digest does not read, each with why a hop that rewrites it gains nothing:
NOT_DIGESTED: dict[str, str] = {
    # a verdict depends on the parameters in effect, not on whether this Step repeated them: the digest
    # reads the session's parameters in their place (``digest_of``'s ``sampling``)
    "sampling": "bound as the sampling parameters in effect, read from the session where the Step has none",
}

_encoder = msgspec.msgpack.Encoder()
_NEVER = object()  # a required field's "default": equal to nothing, so required fields are always digested


def _default(field: msgspec.structs.FieldInfo) -> object:
    if field.default is not msgspec.NODEFAULT:
        return field.default
    return field.default_factory() if field.default_factory is not msgspec.NODEFAULT else _NEVER


# (name, default) of every digested field, in declaration order
_FIELDS = tuple((f.name, _default(f)) for f in msgspec.structs.fields(Step) if f.name not in NOT_DIGESTED)


def digest_of(step: Step, sampling: SamplingParams, key: str) -> int:
    """The digest of ``step`` as a verdict names it: every field not in NOT_DIGESTED and not at its
    default, as (name, value) pairs in declaration order, then the sampling parameters in effect."""
    pairs = [(name, value) for name, default in _FIELDS if (value := getattr(step, name)) != default]
    fields = (pairs, tuple(_digested(v) for v in msgspec.structs.astuple(sampling)))
    mac = hmac.new(key.encode(), _encoder.encode(fields), hashlib.blake2b).digest()
    return int.from_bytes(mac[:DIGEST_BYTES], "little")


def step_digest(key: str, *, sampling: SamplingParams = GREEDY, session_id: str = "", **fields) -> int:
    """``digest_of`` a Step built from ``fields`` (Step's names): for tests and tools that have no Step."""
    return digest_of(Step(session_id=session_id, **fields), sampling, key)


def _digested(value: object) -> object:
    """A sampling field as the digest reads it: a Constraint without stop ids as its two fields (what
    a peer from before ``stop_token_ids`` digested; msgspec writes the empty tuple too)."""
    if isinstance(value, Constraint) and not value.stop_token_ids:
        return (value.kind, value.spec)
    return value
