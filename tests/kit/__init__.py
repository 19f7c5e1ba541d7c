"""Shared test helpers that need no swarm: a fake message stream (streams.py)."""
