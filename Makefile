# One entry point for developers and CI. `make test` is the README's test command.
PYTHON ?= python3
PIP_FLAGS ?= -q

.PHONY: install tools test demo fuzz soak abuse scale images

install:
	$(PYTHON) -m pip install $(PIP_FLAGS) -e '.[dev]'

# Kubernetes control-plane binaries for tests/cluster, tests/operator, tests/chart (cached, see hack/build-tools.sh),
# the LeaderWorkerSet controller for tests/operator/test_leaderworkerset_local.py (hack/build-lws.sh),
# and prometheus-adapter for tests/operator/test_hpa_loop.py (hack/build-prometheus-adapter.sh).
tools:
	bash hack/build-tools.sh
	bash hack/build-lws.sh
	bash hack/build-prometheus-adapter.sh

test: install tools
	$(PYTHON) -P -m pytest

# The README's first command: the operator end to end on a local cluster (builds the tools first if missing).
demo:
	$(PYTHON) -m pip install $(PIP_FLAGS) -e '.[engine,cluster]'
	specdeploy demo

# The engine's API (schemathesis) and the operator (hypothesis-generated resources) fuzzed much
# longer than CI does: tests/engine/serving/test_fuzz_openapi.py, tests/operator/test_fuzz_resources.py.
FUZZ_EXAMPLES ?= 2000
FUZZ_MAX_TIME_S ?= 900
FUZZ_RESOURCES ?= 500
fuzz: tools
	SPECDEPLOY_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) SPECDEPLOY_FUZZ_MAX_TIME_S=$(FUZZ_MAX_TIME_S) SPECDEPLOY_FUZZ_MIN_CASES=3000 \
	  SPECDEPLOY_FUZZ_RESOURCES=$(FUZZ_RESOURCES) \
	  $(PYTHON) -P -m pytest -q -s tests/engine/serving/test_fuzz_openapi.py tests/operator/test_fuzz_resources.py

# Minutes of concurrent streaming clients against the tiny pair on CPU (tests/engine/serving/test_soak.py);
# the figures go to $(SOAK_REPORT) and docs/reliability.md.
SOAK_S ?= 180
SOAK_CLIENTS ?= 32
SOAK_REPORT ?= soak-report.json
soak:
	SPECDEPLOY_SOAK_S=$(SOAK_S) SPECDEPLOY_SOAK_CLIENTS=$(SOAK_CLIENTS) SPECDEPLOY_SOAK_REPORT=$(abspath $(SOAK_REPORT)) \
	  $(PYTHON) -P -m pytest -q -s tests/engine/serving/test_soak.py

# One hostile client's classes against the tiny pair (tests/engine/serving/test_abuse.py); the
# figures go to $(ABUSE_REPORT) and docs/reliability.md.
ABUSE_REPORT ?= abuse-report.json
abuse:
	SPECDEPLOY_ABUSE_REPORT=$(abspath $(ABUSE_REPORT)) $(PYTHON) -P -m pytest -q tests/engine/serving/test_abuse.py

# 200 SpecDecodeDeployments to Ready on the test cluster: time, operator RSS, create -> Deployment p99.
SCALE_RESOURCES ?= 200
SCALE_REPORT ?= scale-report.json
scale: tools
	SPECDEPLOY_SCALE_RESOURCES=$(SCALE_RESOURCES) SPECDEPLOY_SCALE_REPORT=$(abspath $(SCALE_REPORT)) SPECDEPLOY_SCALE_ENFORCE_GOALS=1 \
	  $(PYTHON) -P -m pytest -q -s tests/operator/test_scale.py

# The operator and engine images, built with buildah from a Debian base made by debootstrap (no
# Docker engine, no registry but Debian's and PyPI): hack/build-images.sh.
images:
	bash hack/build-images.sh
	$(PYTHON) -P hack/run-operator-image.py
