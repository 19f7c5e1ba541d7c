"""vLLM's tokenizer endpoints: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

Tools that count tokens or build prompts against a server (lm-evaluation-harness's
``local-completions`` uses all three when they answer; it then needs no tokenizer of its own)
get the served model's own tokenizer, the one the gateway encodes prompts with. The bodies and
replies follow vLLM's; ``model`` may be left out when the gateway serves one model.
"""

from __future__ import annotations

from typing import Any, Optional

import msgspec

from swarm.api.engine import ServedModel
from swarm.api.errors import bad_request
from swarm.api.schemas import ChatMessage, chat_messages


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None  # formatted by the chat template, as /v1/chat/completions does
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: Optional[str] = None
    tokens: list[int]


def tokenize(req: TokenizeRequest, served: ServedModel) -> dict[str, Any]:
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give either prompt (a string) or messages (a chat)", "prompt")
    if req.prompt is not None:
        ids = list(served.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    else:
        messages = chat_messages(req.messages or [])
        ids = served.chat_prompt(messages, add_generation_prompt=req.add_generation_prompt)
    strs = served.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": served.context_length, "tokens": ids, "token_strs": strs}


def detokenize(req: DetokenizeRequest, served: ServedModel) -> dict[str, Any]:
    if any(not 0 <= t < served.vocab_size for t in req.tokens):
        raise bad_request(f"tokens holds ids outside the vocabulary [0, {served.vocab_size})", "tokens")
    return {"prompt": served.tokenizer.decode(req.tokens)}


def tokenizer_info(served: ServedModel) -> dict[str, Any]:
    tokenizer = served.tokenizer
    return {
        "tokenizer_class": type(tokenizer).__name__,
        "eos_token": tokenizer.eos_token,
        "bos_token": tokenizer.bos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
        "chat_template": getattr(tokenizer, "chat_template", None),
        "model_max_length": served.context_length,
        "vocab_size": served.vocab_size,
    }
