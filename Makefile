# One entry point for developers and CI. `make test` is the README's test command.
PYTHON ?= python3
PIP_FLAGS ?= -q

.PHONY: install tools test demo

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
