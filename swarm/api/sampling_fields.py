"""A request's sampling fields (OpenAI's, vLLM's extensions, ``speculation``, ``audit``) -> the keyword
arguments of ``generate()``, each checked with a 400 naming the parameter; split from
swarm/api/schemas.py, which holds the request structs."""

from __future__ import annotations

from typing import Any, Optional, Union

from client._confirmation import AUDIT_POLICIES
from protocol.messages import MAX_LOGIT_BIAS, SamplingParams
from protocol.sampling import validate_sampling
from swarm.api.errors import bad_request

MAX_STOPS = 16
SPECULATION_MODES = {"suffix", "ngram", "tail", "suffix+tail", "ngram+tail", "none"}
INT64 = 2**63


def stops_of(stop: Union[str, list[str], None]) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS:
        raise bad_request(f"at most {MAX_STOPS} stop strings", "stop")
    if any(not s for s in stops):
        raise bad_request("stop strings must not be empty", "stop")
    return tuple(stops)


def sampling_of(req: Any) -> dict[str, Any]:
    """OpenAI's sampling parameters -> generate()'s; temperature 0 means greedy. ``req`` is a
    swarm.api.schemas request (typed there: importing it here would be an import circle)."""
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    # OpenAI's own conventions here (temperature 0 = greedy, top_k -1 = off); the ranges of the
    # sampling parameters themselves are checked by protocol.sampling.validate_sampling below,
    # the same check the client and the tail apply
    checks = [
        (temperature >= 0, "temperature", "temperature must be >= 0"),
        (req.top_k is None or req.top_k >= -1, "top_k", "top_k must be >= 0 (or -1: off)"),
        (req.seed is None or -INT64 <= req.seed < INT64, "seed", "seed must be a 64-bit signed integer"),
        (
            req.speculation is None or req.speculation.lower() in SPECULATION_MODES,
            "speculation",
            f"speculation must be one of {sorted(SPECULATION_MODES)}",
        ),
        (
            req.audit is None or req.audit in AUDIT_POLICIES,
            "audit",
            f"audit must be one of {list(AUDIT_POLICIES)}",
        ),
        (
            req.num_draft_tokens is None or 1 <= req.num_draft_tokens <= 64,
            "num_draft_tokens",
            "num_draft_tokens must be in [1, 64]",
        ),
    ]
    for ok, param, message in checks:
        if not ok:
            raise bad_request(message, param)
    sampling: dict[str, Any] = {
        "do_sample": temperature > 0,
        "temperature": temperature if temperature > 0 else 1.0,
        "top_p": top_p,
        "top_k": max(req.top_k or 0, 0),
        "min_p": req.min_p or 0.0,
        "repetition_penalty": req.repetition_penalty or 1.0,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "logit_bias": _logit_bias(req.logit_bias),
        "seed": req.seed,
    }
    try:
        validate_sampling(SamplingParams(**{k: v for k, v in sampling.items() if k != "seed"}))
    except ValueError as e:
        raise bad_request(str(e), str(e).split(" ", 1)[0]) from None
    if req.speculation is not None:
        sampling["speculation"] = None if req.speculation.lower() == "none" else req.speculation.lower()
    if req.num_draft_tokens is not None:
        sampling["num_draft_tokens"] = req.num_draft_tokens
    if req.audit is not None:
        sampling["audit"] = req.audit
    if req.prediction is not None:
        sampling["draft_corpus"] = [_prediction_text(req.prediction)]
    return sampling


def _logit_bias(bias: Optional[dict[str, float]]) -> dict[int, float]:
    """OpenAI's logit_bias (token ids as JSON keys) -> ids to biases; the range check is validate_sampling's."""
    if not bias:
        return {}
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(f"logit_bias holds at most {MAX_LOGIT_BIAS} token ids", "logit_bias")
    try:
        return {int(token): float(value) for token, value in bias.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids", "logit_bias") from None


def _prediction_text(prediction: Any) -> str:
    if prediction.type != "content":
        raise bad_request("prediction.type must be 'content'", "prediction")
    if isinstance(prediction.content, str):
        return prediction.content
    if any(part.type != "text" or part.text is None for part in prediction.content):
        raise bad_request("only text parts are supported in prediction.content", "prediction")
    return "".join(part.text for part in prediction.content)
