"""Fixtures of the family tests, from tests/kit/families.py (module-scoped: each module that asks
for them builds its own)."""

from tests.kit.families import family_paths, one_torch_thread, references  # noqa: F401
