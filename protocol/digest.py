"""The digest a verdict carries of the Step it verified (docs/design.md, "Trust").

Every hop forwards the Step it received, so a middle hop could rewrite it (a draft, the committed
id, the sampling parameters) and the tail would verify the altered run honestly; the client would
then commit its own drafts on a verdict about others. The tail therefore puts a digest of what it
verified into ``StepResult.step_digest``, and the client compares it with the digest of what it
sent. The digest is keyed with the session's secret, which only the client and the tail know (the
client proves it to the tail in Subscribe; route servers see only its sha256), so no hop can
compute a matching digest for a Step it rewrote: 32 bits make a blind guess pass once in 4 billion,
for 5 bytes per verdict.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Optional, Sequence

import msgspec

from protocol.messages import Constraint

DIGEST_BYTES = 4

_encoder = msgspec.msgpack.Encoder()


def step_digest(
    key: str,
    *,
    run_id: int,
    start_pos: int,
    token_ids: Sequence[int],
    n_draft: int,
    sampling: msgspec.Struct,
    parents: Sequence[int] = (),
    tree_path: Sequence[int] = (),
    draft_q: Optional[bytes] = None,
) -> int:
    """What a verdict depends on besides the caches: positions, ids, drafts (and their tree or q),
    and the sampling parameters in effect (the session's when the Step carried none)."""
    fields = (
        run_id,
        start_pos,
        list(token_ids),
        n_draft,
        list(parents),
        list(tree_path),
        draft_q,
        tuple(_digested(v) for v in msgspec.structs.astuple(sampling)),
    )
    mac = hmac.new(key.encode(), _encoder.encode(fields), hashlib.blake2b).digest()
    return int.from_bytes(mac[:DIGEST_BYTES], "little")


def _digested(value: object) -> object:
    """A sampling field as the digest reads it: a Constraint without stop ids as its two fields, what a
    peer from before ``stop_token_ids`` digests (msgspec writes the empty tuple too)."""
    if isinstance(value, Constraint) and not value.stop_token_ids:
        return (value.kind, value.spec)
    return value


def digest_of(step, sampling: msgspec.Struct, key: str) -> int:
    """``step_digest`` of a Step (any of its kinds), with the sampling parameters in effect."""
    return step_digest(
        key,
        run_id=step.run_id,
        start_pos=step.start_pos,
        token_ids=step.token_ids,
        n_draft=step.n_draft,
        sampling=sampling,
        parents=getattr(step, "parents", ()),
        tree_path=getattr(step, "tree_path", ()),
        draft_q=step.draft_q,
    )
