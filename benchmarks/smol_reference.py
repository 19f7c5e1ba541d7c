"""Local transformers' SmolLM2 answers to one prompt, for benchmarks that compare the swarm's output
with them (benchmarks/lying_tails.py, benchmarks/sybils.py).

Greedy answers come from ``generate``; seeded ones from tests/kit/reference.py ``reference_sample``,
which draws exactly as the swarm's tail does for a seed and stops at EOS, as ``generate()`` does.
"""

from __future__ import annotations

from typing import Any, Callable, Optional


def smollm2_references(
    prompt_text: str, tokens: int
) -> tuple[Any, Any, list[int], Callable[[Optional[int]], list[int]]]:
    """(tokenizer, float32 reference model, the prompt's ids, ``references(seed)``): the reference's
    ``tokens`` new ids after the prompt, greedy for ``seed=None``, else sampled at temperature 0.8,
    top-p 0.9; memoised."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from protocol.messages import SamplingParams
    from protocol.models import ensure_smollm2_checkpoint
    from tests.kit.reference import reference_sample

    path = ensure_smollm2_checkpoint()
    reference = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer(prompt_text)["input_ids"]
    eos = reference.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    made: dict = {}

    def references(seed: Optional[int]) -> list[int]:
        if seed not in made:
            if seed is None:
                with torch.no_grad():
                    out = reference.generate(torch.tensor([prompt]), max_new_tokens=tokens, do_sample=False)
                made[seed] = out[0, len(prompt) :].tolist()
            else:
                params = SamplingParams(do_sample=True, temperature=0.8, top_p=0.9, seed=seed)
                made[seed] = reference_sample(reference, prompt, tokens, params, eos)
        return made[seed]

    return tokenizer, reference, prompt, references
