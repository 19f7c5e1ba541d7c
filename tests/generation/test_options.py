"""generate() and agenerate_stream() share one table of defaults and one check (client/_options.py)."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest

from client._options import GenerationOptions, check_decoding
from client.model import AutoDistributedModel


def test_old_spellings_are_errors_naming_the_argument():
    """The package has had no release: spellings from before a rename are refused, not renamed."""
    options, rest = GenerationOptions.split({"loop_runs": False, "max_new_tokens": 5, "foo": 1})
    assert options.loop_runs is False and options.max_new_tokens == 5 and rest == {"foo": 1}
    for kwargs in ({"head_start": False}, {"head_start": True, "loop_runs": True}):
        with pytest.raises(TypeError, match=re.escape("head_start= is not an argument: the option is loop_runs=")):
            GenerationOptions.split(kwargs)
    for old in ("head", "suffix+head", "ngram+head"):
        options, _ = GenerationOptions.split({"speculation": old})
        with pytest.raises(ValueError, match=re.escape("speculation must be one of") + ".*" + re.escape(repr(old))):
            options.checked()
    for kind in ("suffix", "ngram", "tail", "suffix+tail", "ngram+tail", None):
        assert GenerationOptions(speculation=kind).checked().speculation == kind


def test_decoding_modes_that_do_not_go_together_are_refused_by_name():
    for args, phrase in (
        (("nope", False, 1, None), "verification must be one of"),
        (("match", "yes", 1, None), "draft_tree must be True or False"),
        (("match", True, 3, None), "leave async_speculation off"),
        (("rejection", True, 1, None), "does not go with verification='rejection'"),
        (("match", False, 1, "yes"), "loop_runs must be True, False or None"),
        (("match", False, 3, True), "loop_runs=True runs one chain at a time"),
    ):
        with pytest.raises(ValueError, match=phrase):
            check_decoding(*args)
    # None: on wherever it applies
    assert check_decoding("match", False, 1, None) is True
    assert check_decoding("match", False, 3, None) is False
    assert check_decoding("match", True, 1, None) is False
    assert check_decoding("match", False, 1, None, draft_model=True) is False
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        GenerationOptions(max_new_tokens=-1).checked()


def test_generate_and_agenerate_stream_take_the_same_options():
    """Neither spells a default of its own: both take the options as keywords (the table's)."""
    for method in (AutoDistributedModel.generate, AutoDistributedModel.agenerate_stream):
        parameters = inspect.signature(method).parameters
        shared = [name for name in parameters if name in {f.name for f in dataclasses.fields(GenerationOptions)}]
        assert shared == [] and inspect.Parameter.VAR_KEYWORD in {p.kind for p in parameters.values()}
