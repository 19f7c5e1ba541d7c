"""Fixtures of the family tests, from tests/kit/families.py (checkpoints built once per session,
references loaded once per module that asks for them)."""

from tests.kit.families import family_paths, one_torch_thread, references  # noqa: F401
