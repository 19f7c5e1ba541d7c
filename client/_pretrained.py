"""``from_pretrained``'s keywords: transformers' own go to the config (and tokenizer), any other is an error.

transformers' ``AutoConfig.from_pretrained`` quietly keeps keywords it does not know as config attributes,
so a misspelt or Petals-only argument (``tuning_mode=`` before it was built, ``adapters=``) would vanish
without a word. Here the config's loading keywords and its attributes (``num_hidden_layers=...``) pass,
and so do a few of the tokenizer's; anything else is a TypeError naming it.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PretrainedConfig

# keywords only the tokenizer reads (AutoTokenizer.from_pretrained); the config leaves them unused
TOKENIZER_KEYWORDS = frozenset({"use_fast", "padding_side", "truncation_side", "tokenizer_type", "model_max_length"})


def load_config(source: str, kwargs: dict[str, Any], caller: str = "from_pretrained") -> PretrainedConfig:
    """The model's config with transformers' keywords applied; a TypeError names every keyword that
    neither the config nor the tokenizer knows (none is passed on silently)."""
    config, unused = AutoConfig.from_pretrained(source, return_unused_kwargs=True, **kwargs)
    unknown = sorted(set(unused) - TOKENIZER_KEYWORDS)
    if unknown:
        raise TypeError(
            f"{caller}() got unexpected keyword arguments {unknown}: neither this model's nor transformers' "
            "config keywords (docs/api.md)"
        )
    return config
