"""Call planning: one ``generate`` or ``agenerate_stream`` call's arguments, checked before any
session opens, and what they imply (the wire's sampling parameters with the call's seed, the EOS
ids, the draft corpus as token ids, the spot-check rate, the room a one-call session needs).

Why apart from the facade: both entry points (and every row of a batch) share one checked
:class:`Call`, so a bad argument fails before the swarm is touched, and a seed drawn for the call
is the same for every row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import msgspec
import torch
from transformers import PretrainedConfig

from client._options import GenerationOptions
from client._runs import SessionState
from client._spot_checks import check_rate
from client.draft_model import check_draft_model
from protocol.constraints import (
    ConstraintCompiler,
    constraint_from_options,
    constraint_from_response_format,
    with_stops,
)
from protocol.limits import MAX_TREE_NODES
from protocol.messages import MAX_LOGIT_BIAS, Constraint, SamplingParams
from protocol.sampling import validate_sampling

DEFAULT_MAX_LENGTH = 2048  # positions a sequence may hold when the config does not say


@dataclass(frozen=True)
class Call:
    """One generate() or agenerate_stream() call's checked arguments and what they imply."""

    options: GenerationOptions  # with loop_runs decided
    sampling: SamplingParams  # with the call's seed and constraint (its start set by the decoder)
    eos: list[int]
    corpus: list[list[int]]  # draft_corpus as token ids
    spot_check_rate: float


def plan_call(
    options: GenerationOptions, config: PretrainedConfig, tokenizer: Any, default_spot_check_rate: float
) -> Call:
    """Check a call's options before any session opens (client/_options.py holds the rules the
    decoding modes share), and work out what they imply. ``default_spot_check_rate``: the model's
    (``from_pretrained``'s), used where the call gives none."""
    rate = check_rate(default_spot_check_rate if options.spot_check_rate is None else options.spot_check_rate)
    sampling = sampling_params(
        options.do_sample,
        options.temperature,
        options.top_k,
        options.top_p,
        options.min_p,
        options.repetition_penalty,
        options.seed,
    )
    sampling = with_output_rules(sampling, options, config.vocab_size)
    if options.draft_model is not None:
        check_draft_model(options.draft_model, config.vocab_size)
    constraint = call_constraint(options, tokenizer, config.vocab_size)
    options = options.checked()
    eos, corpus = eos_ids(options.eos_token_id, config), corpus_ids(options.draft_corpus, tokenizer)
    if constraint is not None:  # the matchers (the tail's, the drafts') end where this call ends: at any of eos
        constraint = with_stops(constraint, compiler_for(tokenizer, config.vocab_size), eos)
        sampling = msgspec.structs.replace(sampling, constraint=constraint)
    return Call(options, sampling, eos, corpus, rate)


def with_output_rules(sampling: SamplingParams, options: GenerationOptions, vocab_size: int) -> SamplingParams:
    """The sampling parameters with the call's presence/frequency penalties and logit bias, checked."""
    if options.logit_bias and options.sequence_bias:
        raise ValueError("give logit_bias or sequence_bias, not both (they are one rule)")
    bias = options.logit_bias or one_token_bias(options.sequence_bias)
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias must be a dict of at most {MAX_LOGIT_BIAS} token ids to biases")
    try:
        bias = {int(t): float(b) for t, b in bias.items()}
    except (TypeError, ValueError):
        raise ValueError("logit_bias maps token ids (ints) to biases (numbers)") from None
    if any(not 0 <= t < vocab_size for t in bias):
        raise ValueError(f"logit_bias names a token id outside the vocabulary [0, {vocab_size})")
    sampling = msgspec.structs.replace(
        sampling,
        presence_penalty=float(options.presence_penalty),
        frequency_penalty=float(options.frequency_penalty),
        logit_bias=bias,
    )
    validate_sampling(sampling)
    return sampling


def one_token_bias(sequence_bias: Any) -> dict:
    """transformers' ``sequence_bias`` (``{(id,): bias}`` or ``[[[id], bias], ...]``) as logit_bias: its
    one-token sequences are exactly the per-token bias the tail applies (generate()'s
    SequenceBiasLogitsProcessor). A longer sequence biases a token by the ones before it, a rule the
    tail does not have: a ValueError naming it, never a silent drop."""
    if not sequence_bias:
        return {}
    bias = {}
    for entry in sequence_bias.items() if isinstance(sequence_bias, dict) else sequence_bias:
        ids, value = entry if isinstance(entry, (list, tuple)) and len(entry) == 2 else (None, None)
        if not isinstance(ids, (list, tuple)) or len(ids) != 1:
            raise ValueError(f"sequence_bias takes one-token sequences only ([[token id], bias]), got {entry!r}")
        bias[ids[0]] = value
    return bias


def call_constraint(options: GenerationOptions, tokenizer: Any, vocab_size: int) -> Optional[Constraint]:
    """The call's constraint (the decoder sets ``output_start`` to the prompt's length), compiled here once
    so that one the library refuses is a ValueError before any server is asked."""
    from_format = constraint_from_response_format(options.response_format)
    constraint = constraint_from_options(
        options.guided_json, options.guided_regex, options.guided_choice, options.guided_grammar
    )
    if from_format is not None and constraint is not None:
        raise ValueError("give response_format or a guided_* argument, not both")
    constraint = constraint or from_format
    if constraint is not None:
        compiler_for(tokenizer, vocab_size).compile(constraint)
    return constraint


@functools.lru_cache(maxsize=4)
def compiler_for(tokenizer: Any, vocab_size: int) -> ConstraintCompiler:
    """One compiler per tokenizer (building its vocabulary table takes a tenth of a second)."""
    return ConstraintCompiler(tokenizer, vocab_size)


def check_audit_every(verdict_audit_every: int) -> int:
    """``from_pretrained``'s ``verdict_audit_every``, checked: tokens per verdict audit, 0 for none."""
    if isinstance(verdict_audit_every, bool) or not isinstance(verdict_audit_every, int) or verdict_audit_every < 0:
        raise ValueError(f"verdict_audit_every must be an int >= 0 (0: no verdict audits), got {verdict_audit_every!r}")
    return verdict_audit_every


def sampling_params(
    do_sample: bool,
    temperature: float,
    top_k: Optional[int],
    top_p: float,
    min_p: float,
    repetition_penalty: float,
    seed: Optional[int],
) -> SamplingParams:
    """transformers' arguments -> the wire's SamplingParams; no seed draws a random one."""
    sampling = SamplingParams(
        do_sample=do_sample,
        temperature=temperature,
        top_k=top_k or 0,
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition_penalty,
        seed=seed if seed is not None else int(torch.randint(0, 2**31 - 1, ()).item()),
    )
    validate_sampling(sampling)
    if not do_sample:  # argmax: only the repetition penalty can change it; the rest stays off the wire
        return SamplingParams(repetition_penalty=repetition_penalty)
    return sampling


def eos_ids(eos_token_id: Union[int, Sequence[int], None], config: PretrainedConfig) -> list[int]:
    """The call's end-of-sequence ids as a list; ``None``: the model config's (none if it has none)."""
    if eos_token_id is None:
        eos_token_id = config.eos_token_id
    if eos_token_id is None:
        return []
    return [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)


def corpus_ids(draft_corpus: Sequence[Union[str, Sequence[int]]], tokenizer: Any) -> list[list[int]]:
    """``draft_corpus`` as token ids: texts are encoded without special tokens, id lists kept."""
    return [tokenizer.encode(c, add_special_tokens=False) if isinstance(c, str) else list(c) for c in draft_corpus]


def context_limit(config: PretrainedConfig) -> int:
    """The most positions (prompt + new tokens) one sequence may hold."""
    return int(getattr(config, "max_position_embeddings", None) or DEFAULT_MAX_LENGTH)


def one_call_session(row: list[int], call: Call, limit: int) -> SessionState:
    """A one-call session: room for the prompt, the new tokens and one run's drafts (a tree's
    nodes), within the model's context ``limit``; the servers reserve that much cache for it."""
    options = call.options
    drafts = max(options.num_draft_tokens, MAX_TREE_NODES) if options.draft_tree else options.num_draft_tokens
    return SessionState(max_length=min(len(row) + options.max_new_tokens + drafts + 1, limit))
