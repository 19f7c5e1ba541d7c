"""The test kit: every helper that more than one test module, or a test and a benchmark, use.

Benchmarks import from here and nowhere else in tests/; tests never import benchmarks/
(tests/test_layout.py checks both). One job per module:

- records.py: ``srv``, a ServerInfo for tests without a swarm
- waiting.py: ``wait_until``, polling with a deadline
- swarms.py: the tiny swarm's layout, in-process servers (``start_inprocess``), ``servers_by_name``
- last_use.py: stopping a shared swarm after its last test; threads.py: one torch thread
- routes.py: pinned and preferred routes; reference.py: prompts and the reference sampler
- drafters.py: a scripted drafter; raw_sessions.py: sessions spoken by hand on the wire
- checkpoints.py, deepseek_quant.py: tiny random checkpoints, DeepSeek's quantized layout
- families.py: the family tests' fixtures (tiny checkpoints per family, references), the servers'
  quantization recipe in one process, a client over CLI servers; mxfp4.py: gpt-oss's MXFP4 layout
- faults.py, faulty_server.py: liars and slow servers (``python -m tests.kit.faulty_server``)
- batch_rows.py: the batching tests' prompts, members of a batched pass alone and together, greedy truth
- oracle.py: an oracle target for the decoder; streams.py: a fake message stream
- browser.py: headless Chromium; netns.py: the network-namespace testbed
- synthetic_swarm.py, dht_swarm.py, route_yardstick.py: swarms of records, DHT peers, and the
  router's yardstick at scale; churn.py: the churn run; prompts.py: the benchmarks' prompts
"""
