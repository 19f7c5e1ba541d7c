"""The swarm health dashboard: ``python -m swarm.dashboard --initial-peers MADDR ...``.

A DHT client polls the model registry and every block's server records every few seconds,
turns what it read into events (:mod:`.events`), folds them into a state (:mod:`.state`), and an
aiohttp app serves that state as a page (``static/``), as JSON (:mod:`.views`, documented in
``docs/dashboard.md``) and as Prometheus metrics (:mod:`.metrics`).
"""
