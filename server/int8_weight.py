"""How a server's bitsandbytes layers compute: LLM.int8 weights weight-only (:class:`Int8WeightLinear`),
NF4 without CPU repacking (:func:`as_served`).

Its own module because defining the class imports bitsandbytes, which costs 4-8 s of CPU at
start on these machines; server/quantization.py imports it only when a server quantizes."""

from __future__ import annotations

import bitsandbytes as bnb
import torch


class Int8WeightLinear(bnb.nn.Linear8bitLt):
    """LLM.int8's weights (int8, one float32 scale per output row, bitsandbytes' ``Int8Params``)
    multiplied weight-only: dequantized to the input's dtype on use, then an ordinary float matmul
    (the formula of bitsandbytes' own CPU path, ``MatMul8bitFp``).

    Why not LLM.int8's int8 x int8 matmul: it quantizes the *activations* too, row by row, and a
    rounding step is a discontinuity. The last-bit float differences that a run of several
    positions has against one-position calls (other kernels, other blocking) then flip roundings
    and grow into different tokens: on SmolLM2 over 3 servers the default speculation changed 3 of
    4 greedy answers against no speculation (with the outlier threshold at 0; at transformers'
    default of 6.0 the outlier columns even depend on the other positions of the run: 2 of 4).
    Weight-only, a position's result is as continuous in its inputs as an unquantized layer's, so
    speculation never changes the output, and precision is better (activations stay in float).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.data.to(x.dtype).mul_(self.weight.SCB.unsqueeze(1).mul(1.0 / 127.0).to(x.dtype))
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return torch.nn.functional.linear(x, weight, bias)


def as_served(module: torch.nn.Module) -> torch.nn.Module:
    """Make the bitsandbytes layers under ``module`` compute as a server's do (also a model loaded
    by transformers with a ``BitsAndBytesConfig``, for references):

    - every ``Linear8bitLt`` computes as :class:`Int8WeightLinear` (same storage, same weights);
    - no ``Linear4bit`` repacks its weights for bitsandbytes' AVX512-BF16 CPU kernel on first use.
      That repacking rounds the absmax scales to bfloat16, so a CPU with AVX512-BF16 would compute
      other values than one without (servers of one quantization should agree wherever they run:
      spot-checks compare them), it changes the resident size the memory plan counts, and it fails
      outright on layers whose input width is not a multiple of the 64-value block (bitsandbytes
      0.50: ``shape '[32, 0]' is invalid``). It costs CPU speed on such machines only; CUDA is
      unaffected.
    """
    for child in module.modules():
        if type(child) is bnb.nn.Linear8bitLt:
            child.__class__ = Int8WeightLinear
        elif isinstance(child, bnb.nn.Linear4bit):
            child.support_avx512bf16_for_cpu = False
    return module
