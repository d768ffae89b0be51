# Source on a GPU machine that has torch but not this package: makes the checkout importable as
# `specdeploy` without installing it, and installs wheels from .whl/ if any (offline machines;
# hack/device-wheels.py gathers them).

_root=$(pwd)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
mkdir -p /tmp/shim/specdeploy
for f in "$_root"/specdeploy/*.py; do ln -sf "$f" /tmp/shim/specdeploy/; done
ln -sfn "$_root/engine" /tmp/shim/specdeploy/engine
ln -sfn "$_root/operator" /tmp/shim/specdeploy/operator
ln -sfn "$_root/localcluster" /tmp/shim/specdeploy/localcluster
export PYTHONPATH=/tmp/shim${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
