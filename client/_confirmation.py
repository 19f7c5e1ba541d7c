"""How each returned token was confirmed, and what the caller is told about the rest
(docs/reliability.md, "What is confirmed").

A token is *confirmed by a trusted server* when a trusted tail committed it or a trusted shadow
re-verified it; *confirmed by an untrusted one* when an independent shadow (client/_witnesses.py)
re-verified it; otherwise *unconfirmed*: the swarm had no independent second tail of the tail's
blocks and precision, the last audit failed, or a dispute was left unsettled
(client/_verdict_audits.py). Unconfirmed tokens are counted in the stats and flagged with an
:class:`UnconfirmedTokensWarning`; ``audit="required"`` raises instead.
"""

from __future__ import annotations

import warnings
from typing import Collection, Optional

from client._stats import GenerationStats
from client.errors import UnconfirmedTokensError, UnconfirmedTokensWarning

AUDIT_POLICIES = ("warn", "required")


def check_audit_policy(audit: str) -> str:
    if audit not in AUDIT_POLICIES:
        raise ValueError(f"audit must be one of {AUDIT_POLICIES}, got {audit!r}")
    return audit


def check_audit_witnesses(witnesses: int) -> int:
    """``audit_witnesses``: how many independent tails verify each verdict audit (at least 1)."""
    if isinstance(witnesses, bool) or not isinstance(witnesses, int) or witnesses < 1:
        raise ValueError(f"audit_witnesses must be an int >= 1 (tails that verify each audit), got {witnesses!r}")
    return witnesses


def count(
    stats: GenerationStats,
    history: list[int],
    prompt_len: int,
    audited: Optional[list[int]],
    trusted_confirmed: Collection[int],
    trusted_tail: Collection[int],
    disputed_only: Collection[int] = (),
) -> None:
    """Fill the stats' three counts for ``history[prompt_len:]``: ``audited`` is the prefix the
    verdict audits confirmed (None: no verdict audits), ``trusted_confirmed`` the positions a trusted
    shadow confirmed, ``trusted_tail`` the positions a trusted tail committed, ``disputed_only`` the
    positions of ``audited`` that only witnesses the generation avoids after an unsettled dispute
    confirmed: unconfirmed (such a witness may be the other side's sybil; issue 35)."""
    confirmed = 0
    for a, b in zip(audited or [], history):
        if a != b:
            break
        confirmed += 1
    stats.tokens_confirmed_trusted = stats.tokens_confirmed_untrusted = stats.tokens_unconfirmed = 0
    for position in range(prompt_len, len(history)):
        if position in trusted_tail or (position < confirmed and position in trusted_confirmed):
            stats.tokens_confirmed_trusted += 1
        elif position < confirmed and position not in disputed_only:
            stats.tokens_confirmed_untrusted += 1
        else:
            stats.tokens_unconfirmed += 1


def why(stats: GenerationStats) -> str:
    """A short reason from the stats, for the warning and the error."""
    if stats.disputed_peers:
        return f"a dispute between {sorted(set(stats.disputed_peers))} that no trusted server settled"
    if stats.verdict_audits_failed:
        return "a verdict audit failed (a server died, refused or timed out)"
    if stats.verdict_audits_skipped:
        return "no independent second server of the tail's blocks and precision"
    return "no verdict audit ran (verdict_audit_every=0, or no second tail)"


def report(stats: GenerationStats, audit: str) -> None:
    """Warn about unconfirmed tokens, or raise under ``audit="required"``."""
    if not stats.tokens_unconfirmed:
        return
    message = (
        f"{stats.tokens_unconfirmed} of {stats.new_tokens} generated tokens are unconfirmed: {why(stats)}. "
        "Name servers you trust with trusted_peers=[...] to settle disputes and confirm tokens"
    )
    if audit == "required":
        raise UnconfirmedTokensError(message + ' (audit="required" refuses to return them)', stats)
    warnings.warn(message, UnconfirmedTokensWarning, stacklevel=4)
