"""The arguments ``generate`` and ``agenerate_stream`` share: one table of defaults, one check.

Both take transformers' names where transformers has one (``max_new_tokens``, ``do_sample``,
``temperature``, ``top_k``, ``top_p``, ``min_p``, ``repetition_penalty``, ``eos_token_id``) and
ours for the rest. They are checked once, at the edge (``GenerationOptions.checked``, before any
session opens); the decoder and its modes take them as checked. Spellings from before a rename
(``head_start=``, ``speculation="head"``) are errors: the package has had no release to keep them for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from client._confirmation import check_audit_policy, check_audit_witnesses
from client._witnesses import trusted_set
from client.drafting import DRAFTER_KINDS
from client.drafting.cost_model import check_lap_costs

VERIFICATION_RULES = ("match", "rejection")
RENAMED_ARGUMENTS = {"head_start": "loop_runs"}  # refused by name: generate() only warns about other unknown ones


@dataclass(frozen=True)
class GenerationOptions:
    """Every generation argument beyond the prompt, with its default (``generate``'s docstring
    says what each does)."""

    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: Optional[int] = None  # None: a random seed per call
    eos_token_id: Union[int, Sequence[int], None] = None  # None: the model config's
    speculation: Optional[str] = "suffix"  # "suffix", "ngram", "tail", "suffix+tail", "ngram+tail" or None
    num_draft_tokens: int = 8
    draft_lap_costs: Optional[tuple[float, float]] = None  # (fixed_s, per_position_s): the cost model's fixed prices
    async_speculation: bool = False
    max_inflight_runs: int = 3  # with async_speculation only
    draft_corpus: Sequence[Union[str, Sequence[int]]] = ()
    num_logprobs: int = 0
    draft_model: Any = None
    verification: str = "match"  # or "rejection"
    spot_check_rate: Optional[float] = None  # None: from_pretrained's
    draft_tree: bool = False
    loop_runs: Optional[bool] = None  # None: on wherever it applies
    trusted_peers: Optional[Sequence[str]] = None  # None: from_pretrained's (docs/reliability.md, "Witnesses")
    audit: str = "warn"  # unconfirmed tokens: "warn" flags them, "required" raises (client/_confirmation.py)
    audit_witnesses: int = 6  # the verdict audits' pool (client/_shadow_turns.py SHADOW_POOL): more close sybil gaps
    # structured outputs (docs/api.md, "Structured outputs"): at most one of these, vLLM's names
    guided_json: Any = None  # a JSON schema (dict or JSON text)
    guided_regex: Optional[str] = None
    guided_choice: Optional[Sequence[str]] = None
    guided_grammar: Optional[str] = None  # EBNF (xgrammar's dialect)
    response_format: Optional[dict] = None  # OpenAI's: {"type": "json_object"} or {"type": "json_schema", ...}
    # OpenAI's penalties over the generated tokens, and logit_bias {token id: bias in [-100, 100]}
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[dict] = None
    sequence_bias: Any = None  # transformers' name, one-token sequences only: the same rule as logit_bias
    grammar_drafts: bool = True  # under a constraint, draft the tokens it forces ahead of speculation's drafts

    @classmethod
    def split(cls, kwargs: dict[str, Any]) -> tuple["GenerationOptions", dict[str, Any]]:
        """The options among ``kwargs``, and the rest. An argument renamed before the first release is
        refused by name, not ignored as another unknown argument would be by ``generate``."""
        for old, new in RENAMED_ARGUMENTS.items():
            if old in kwargs:
                raise TypeError(f"{old}= is not an argument: the option is {new}=")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in kwargs.items() if k in names}), {
            k: v for k, v in kwargs.items() if k not in names
        }

    @property
    def inflight(self) -> int:
        """Runs in flight at most."""
        return self.max_inflight_runs if self.async_speculation else 1

    def checked(self) -> "GenerationOptions":
        """These options checked (max_new_tokens, decoding modes that go together) before any
        session opens, with ``loop_runs`` decided."""
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.speculation is not None and self.speculation not in DRAFTER_KINDS:
            raise ValueError(f"speculation must be one of {DRAFTER_KINDS} or None, got {self.speculation!r}")
        check_audit_policy(self.audit)
        check_audit_witnesses(self.audit_witnesses)
        if self.draft_lap_costs is not None:
            check_lap_costs(self.draft_lap_costs)
        trusted_set(self.trusted_peers)
        loop_runs = check_decoding(
            self.verification, self.draft_tree, self.inflight, self.loop_runs, self.draft_model is not None
        )
        return dataclasses.replace(self, loop_runs=loop_runs)


def check_decoding(
    verification: str, draft_tree: bool, inflight: int, loop_runs: Optional[bool], draft_model: bool = False
) -> bool:
    """The one check that the decoding modes asked for go together; returns ``loop_runs``
    decided (None: on wherever it applies, measured best in docs/benchmarks.md).

    Token trees and looped runs run one run at a time (a run sent behind a tree would have to guess
    its path; a looped run is the only one in flight), and both verify by token match."""
    if verification not in VERIFICATION_RULES:
        raise ValueError(f"verification must be one of {VERIFICATION_RULES}, got {verification!r}")
    if not isinstance(draft_tree, bool):
        raise ValueError(f"draft_tree must be True or False, got {draft_tree!r}")
    if draft_tree and inflight > 1:
        raise ValueError("draft_tree=True runs synchronous speculation: leave async_speculation off")
    if draft_tree and verification == "rejection":
        raise ValueError("draft_tree=True verifies by token match: it does not go with verification='rejection'")
    if loop_runs is None:
        loop_runs = inflight == 1 and not draft_tree and verification == "match" and not draft_model
    if not isinstance(loop_runs, bool):
        raise ValueError(f"loop_runs must be True, False or None, got {loop_runs!r}")
    if loop_runs and (inflight > 1 or draft_tree or verification == "rejection"):
        raise ValueError(
            "loop_runs=True runs one chain at a time verified by token match: leave "
            "async_speculation, draft_tree and verification='rejection' off"
        )
    return loop_runs
