"""Constraints (structured outputs) compiled and tracked by position, with xgrammar.

A :class:`~protocol.messages.Constraint` (JSON schema, any JSON object, regex, EBNF grammar) is part
of the sampling rule (docs/design.md, "Constraints at the tail"): the token at absolute position t
is chosen from the logits masked by the constraint's state after the tokens at positions
``output_start .. t-1``. That state is a pure function of those tokens, so a :class:`Guide` keeps one
xgrammar ``GrammarMatcher`` and, before each mask, brings it to the context it is asked about: it
rolls back to the longest prefix it shares with what it has accepted and accepts the rest. The
protocol's one rollback (trim to ``start_pos``), a rejected draft, a tree's other branch and a
failover's replay all reach the same state this way, with no bookkeeping of their own.

Why xgrammar (0.2.9): its matcher rolls back any number of tokens (``rollback(n)``, what exact
speculation needs), its token masks are a bitmask applied in place on CPU, it compiles JSON
schemas, regexes and EBNF against a Hugging Face tokenizer, transformers has its own logits
processor for it (``xgrammar.contrib.hf.LogitsProcessor``: the reference our tests compare with), and
it installs as a wheel with no compiler. llguidance does the same with a Rust core; xgrammar's
rollback and forced-token helpers (``find_jump_forward_tokens``) fit the client's drafting too.

Both sides use this module: the client compiles a call's constraint before any server is asked
(a ValueError naming the problem) and drafts the tokens it forces; the tail masks its choices.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, Optional, Sequence

import msgspec
import torch

from protocol.limits import MAX_STOP_TOKEN_IDS
from protocol.messages import CONSTRAINT_KINDS, MAX_CONSTRAINT_CHARS, Constraint

MAX_COMPILED = 32  # compiled grammars a compiler keeps (a tail serves many sessions with few schemas)
MAX_CHOICES = 256  # a choice list's entries (they become one grammar alternative each)


def _xgrammar() -> Any:
    import xgrammar  # imported on first use: a server that never sees a constraint does not load it

    return xgrammar


def constraint_from_options(
    guided_json: Any = None,
    guided_regex: Optional[str] = None,
    guided_choice: Optional[Sequence[str]] = None,
    guided_grammar: Optional[str] = None,
    json_object: bool = False,
) -> Optional[Constraint]:
    """vLLM's guided-decoding arguments -> one Constraint; None when none is given. Raises ValueError
    for two at once or a malformed one."""
    given = [
        n
        for n, v in (
            ("guided_json", guided_json),
            ("guided_regex", guided_regex),
            ("guided_choice", guided_choice),
            ("guided_grammar", guided_grammar),
            ("json_object", json_object or None),
        )
        if v is not None
    ]
    if len(given) > 1:
        raise ValueError(f"give one constraint at a time, got {' and '.join(given)}")
    if guided_json is not None:
        if isinstance(guided_json, str):
            try:
                guided_json = json.loads(guided_json)
            except ValueError as e:
                raise ValueError(f"guided_json is not valid JSON: {e}") from None
        if not isinstance(guided_json, (dict, bool)):
            raise ValueError(f"guided_json must be a JSON schema (an object), got {type(guided_json).__name__}")
        return _checked(Constraint("json_schema", json.dumps(guided_json, separators=(",", ":"))), "guided_json")
    if guided_regex is not None:
        if not isinstance(guided_regex, str) or not guided_regex:
            raise ValueError("guided_regex must be a non-empty string")
        return _checked(Constraint("regex", guided_regex), "guided_regex")
    if guided_choice is not None:
        return _checked(Constraint("grammar", choice_grammar(guided_choice)), "guided_choice")
    if guided_grammar is not None:
        if not isinstance(guided_grammar, str) or not guided_grammar.strip():
            raise ValueError("guided_grammar must be a non-empty EBNF grammar")
        return _checked(Constraint("grammar", guided_grammar), "guided_grammar")
    if json_object:
        return Constraint("json_object")
    return None


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose sentences are exactly ``choices`` (vLLM's guided_choice)."""
    if isinstance(choices, str) or not isinstance(choices, Sequence) or not choices:
        raise ValueError("guided_choice must be a non-empty list of strings")
    if len(choices) > MAX_CHOICES or not all(isinstance(c, str) and c for c in choices):
        raise ValueError(f"guided_choice must hold 1 to {MAX_CHOICES} non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)  # JSON escapes are EBNF string escapes


def _checked(constraint: Constraint, name: str) -> Constraint:
    if len(constraint.spec) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"{name} is {len(constraint.spec)} characters; the limit is {MAX_CONSTRAINT_CHARS}")
    return constraint


class ConstraintCompiler:
    """Compiles constraints against one tokenizer (``vocab_size``: the logits' width, which may exceed
    the tokenizer's own vocabulary), keeping the last MAX_COMPILED compiled grammars."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info)
        self._compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()

    def is_compiled(self, constraint: Constraint) -> bool:
        """Whether ``constraint`` is in the cache (compiling it again costs nothing)."""
        return (constraint.kind, constraint.spec) in self._compiled

    def compile(self, constraint: Constraint) -> Any:
        """The xgrammar CompiledGrammar; ValueError naming what the library refused."""
        key = (constraint.kind, constraint.spec)
        if key in self._compiled:
            self._compiled.move_to_end(key)
            return self._compiled[key]
        compiled = self._compile(constraint)
        self._compiled[key] = compiled
        if len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)
        return compiled

    def _compile(self, constraint: Constraint) -> Any:
        kind, spec = constraint.kind, constraint.spec
        if kind not in CONSTRAINT_KINDS:
            raise ValueError(f"constraint kind must be one of {CONSTRAINT_KINDS}, got {kind!r}")
        try:
            if kind == "json_object":
                return self._compiler.compile_builtin_json_grammar()
            if kind == "json_schema":
                # one layout (no free whitespace): the grammar then forces keys, quotes and separators
                # (drafts the client knows), and a weak model cannot pad the output with spaces forever
                return self._compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
            if kind == "regex":
                return self._compiler.compile_regex(spec)
            return self._compiler.compile_grammar(spec)
        except Exception as e:  # xgrammar raises RuntimeError, ValueError and its own errors
            raise ValueError(f"the {kind} constraint does not compile: {str(e).strip()[:500]}") from None

    def guide(self, constraint: Constraint, start: int) -> "Guide":
        """A Guide matching the tokens from absolute position ``start`` (the output's first) on."""
        return Guide(self.compile(constraint), constraint, start, self.vocab_size)


class Guide:
    """One session's matcher, kept by position: :meth:`apply` masks the scores that choose the
    token after ``context`` (every id at positions < t), whatever contexts it was asked about before."""

    def __init__(self, compiled: Any, constraint: Constraint, start: int, vocab_size: int):
        xgr = _xgrammar()
        self.constraint, self.start, self.vocab_size = constraint, start, vocab_size
        stops = matcher_stops(compiled, constraint, vocab_size)
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)
        self._accepted: list[int] = []  # the ids the matcher holds, from position start on
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def _follow(self, tokens: Sequence[int]) -> bool:
        """Bring the matcher to ``tokens`` (the ids from ``start`` on); False when they end the
        grammar (a stop token) before their last: positions after the end are not constrained."""
        held = self._accepted
        common = min(len(held), len(tokens))
        if held[:common] != list(tokens[:common]):
            common = next(i for i, (a, b) in enumerate(zip(held, tokens)) if a != b)
        if len(held) > common:
            self._matcher.rollback(len(held) - common)
            del held[common:]
        for position, token in enumerate(tokens[common:], start=self.start + common):
            if self._matcher.is_terminated():
                return False
            if not self._matcher.accept_token(int(token)):
                raise ValueError(f"token {token} at position {position} does not match the session's constraint")
            held.append(int(token))
        return not self._matcher.is_terminated()

    def apply(self, scores: torch.Tensor, context: Sequence[int]) -> torch.Tensor:
        """Mask [1, vocab] scores in place (-inf where the constraint forbids), as xgrammar's
        transformers processor does; returns them. A dead end (the mask allows no id at all: a
        grammar the vocabulary cannot spell) allows the stop tokens instead, so the generation ends
        there with EOS rather than failing on a row of -inf (xgrammar's processor would choose id 0
        greedily and fail to sample)."""
        if len(context) < self.start or not self._follow(context[self.start :]):
            return scores
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        if not bool(self._bitmask.any()):
            keep = scores[:, list(self._matcher.stop_token_ids)].clone()
            scores.fill_(float("-inf"))
            scores[:, list(self._matcher.stop_token_ids)] = keep
            return scores
        _xgrammar().apply_token_bitmask_inplace(scores, self._bitmask)
        return scores

    def ended(self, context: Sequence[int]) -> bool:
        """Whether the constraint ended at the last of ``context`` (or before): a stop id taken where
        the grammar may end, the matcher then terminated (accepting), nothing after it masked."""
        return len(context) >= self.start and not self._follow(context[self.start :])

    def forced(self, context: Sequence[int], limit: int, certain: bool = False) -> list[int]:
        """Up to ``limit`` drafts after ``context`` from the constraint alone: each id its mask leaves
        no choice about (the tail must choose it), and where there is a choice but the text is forced,
        xgrammar's tokenization of that text (``find_jump_forward_tokens``: likely, not certain, ids),
        for as long as either goes on; ``certain``: the first kind only (a draft model knows the
        model's own tokenization of forced text better). The matcher is left at ``context``."""
        if limit <= 0 or len(context) < self.start or not self._follow(context[self.start :]):
            return []
        drafts: list[int] = []
        while len(drafts) < limit and not self._matcher.is_terminated():
            self._matcher.fill_next_token_bitmask(self._bitmask, 0)
            only = _only_allowed(self._bitmask, self.vocab_size)
            if only is None and certain:
                break
            step = [only] if only is not None else self._matcher.find_jump_forward_tokens()[: limit - len(drafts)]
            taken = 0
            for token in step:  # one by one, so that what the matcher holds is always what _accepted says
                if not self._matcher.accept_token(token):
                    break
                self._accepted.append(token)
                drafts.append(token)
                taken += 1
            if taken < len(step) or not step:
                break
        self._follow(context[self.start :])  # back to where the caller is
        return drafts

    def valid_prefix(self, context: Sequence[int], tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (after ``context``) the constraint allows in a row; the matcher is
        left at ``context``."""
        if len(context) < self.start or not self._follow(context[self.start :]):
            return len(tokens)
        count = 0
        for token in tokens:
            if self._matcher.is_terminated() or not self._matcher.accept_token(int(token)):
                break
            self._accepted.append(int(token))
            count += 1
        self._follow(context[self.start :])
        return count


def matcher_stops(compiled: Any, constraint: Constraint, vocab_size: int) -> Optional[list[int]]:
    """The stop ids of a matcher of ``constraint``: the tokenizer's EOS and the constraint's own
    ``stop_token_ids`` (the other ids the client ends the output at), so that the matcher ends
    exactly where the client does; None (xgrammar's: the tokenizer's) without any. ValueError for
    an id outside the vocabulary (xgrammar would abort on it)."""
    if not constraint.stop_token_ids:
        return None
    bad = [t for t in constraint.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"the constraint's stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
    return sorted(set(compiled.tokenizer_info.stop_token_ids) | set(constraint.stop_token_ids))


def with_stops(constraint: Constraint, compiler: ConstraintCompiler, stop_ids: Sequence[int]) -> Constraint:
    """``constraint`` with the ids among ``stop_ids`` (the ids a call ends at) that the tokenizer's EOS
    does not already cover as its ``stop_token_ids``; the same constraint when there are none (the
    common case: nothing more on the wire). ValueError past MAX_STOP_TOKEN_IDS."""
    extra = tuple(sorted(set(stop_ids) - set(compiler.tokenizer_info.stop_token_ids)))
    if any(not 0 <= t < compiler.vocab_size for t in extra):
        raise ValueError(f"eos_token_id {list(extra)} has ids outside the vocabulary [0, {compiler.vocab_size})")
    if len(extra) > MAX_STOP_TOKEN_IDS:
        raise ValueError(f"a constrained call ends at most at {MAX_STOP_TOKEN_IDS} ids besides EOS, not {len(extra)}")
    return msgspec.structs.replace(constraint, stop_token_ids=extra) if extra else constraint


def _only_allowed(bitmask: torch.Tensor, vocab_size: int) -> Optional[int]:
    """The one id a [1, words] int32 bitmask allows, or None when it allows several (or none)."""
    words = bitmask[0]
    nonzero = torch.nonzero(words).flatten()
    if len(nonzero) != 1:
        return None
    word = int(words[nonzero[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    token = 32 * int(nonzero[0]) + word.bit_length() - 1
    return token if token < vocab_size else None


def constraint_from_response_format(response_format: Any) -> Optional[Constraint]:
    """OpenAI's ``response_format`` -> a Constraint: {"type": "text"} is none, {"type": "json_object"}
    any JSON object, {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}} that schema.
    ValueError naming the field that is wrong."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise ValueError('response_format must be an object with a "type"')
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind != "json_schema":
        raise ValueError(f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}')
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise ValueError('response_format.json_schema must be an object with a "schema" object')
    return constraint_from_options(guided_json=spec.get("schema", {}))
