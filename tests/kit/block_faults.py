"""Faults of a tail that a dispute's bisection over its blocks catches (client/_bisection.py): one block
computed wrongly, or a final hidden state made up to fit a lie. Kept apart from tests/kit/faults.py
(its line limit); applied by tests/kit/faulty_server.py."""

from __future__ import annotations

import logging

from tests.kit.faults import Counter

logger = logging.getLogger(__name__)


def corrupt_block(span, block: int, offset: float) -> None:
    """From now on block ``block`` of ``span`` adds ``offset`` to its output (a forward hook on its MLP,
    whose output the block adds to the residual: the single and the batched pass alike). Everything
    after it is computed honestly from the wrong state: a server whose one block is wrong, which a
    dispute's bisection narrows to that block (client/_bisection.py)."""
    if not span.start <= block < span.end:
        raise ValueError(f"block {block} is not in the span {span.start}:{span.end}")
    span.layers[block - span.start].mlp.register_forward_hook(lambda module, args, out: out + offset)
    logger.warning(f"Fault injection: block {block}'s output is off by {offset:g}")


def made_up_final_hidden(offset: float) -> Counter:
    """From now on this process's tails add ``offset`` to every *final* hidden state they return
    (``server.compute._outputs`` patched), never to a block boundary's state (``Step.hidden_at``): a
    tail that makes up the h it sends as a dispute's evidence, honest in every block."""
    from server import compute as compute_module

    count, outputs = Counter(1), compute_module._outputs

    def made_up(span, session, step, *args, **kwargs):
        messages = outputs(span, session, step, *args, **kwargs)
        if step.return_hidden and step.hidden_at == -1:
            messages = [(message, [tensors[0], tensors[1] + offset]) for message, tensors in messages]
            count.due()
        return messages

    compute_module._outputs = made_up
    return count
