# One entry point for developers and CI. `make test` is the README's test command.
PYTHON ?= python3
PIP_FLAGS ?= -q

.PHONY: install tools test demo fuzz

install:
	$(PYTHON) -m pip install $(PIP_FLAGS) -e '.[dev]'

# Kubernetes control-plane binaries for tests/cluster, tests/operator, tests/chart (cached, see hack/build-tools.sh).
tools:
	bash hack/build-tools.sh

test: install tools
	$(PYTHON) -P -m pytest

demo:
	$(PYTHON) -m pip install $(PIP_FLAGS) -e '.[engine]'
	specdeploy demo

# The engine's API fuzzed much longer than CI does (tests/engine/serving/test_fuzz_openapi.py).
FUZZ_EXAMPLES ?= 2000
FUZZ_MAX_TIME_S ?= 900
fuzz:
	SPECDEPLOY_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) SPECDEPLOY_FUZZ_MAX_TIME_S=$(FUZZ_MAX_TIME_S) SPECDEPLOY_FUZZ_MIN_CASES=3000 \
	  $(PYTHON) -P -m pytest -q -s tests/engine/serving/test_fuzz_openapi.py
