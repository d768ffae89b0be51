# Source on a GPU machine that has torch but not this package: makes the checkout importable as
# `specdeploy` without installing it, installs wheels from .whl/ if any (offline machines;
# hack/device-wheels.py gathers them), and where .dg/deepgemm.tgz was carried
# (hack/deepgemm-bundle.sh) makes DeepGEMM importable: built against this machine's torch by
# hack/build-deepgemm.py, or a .dg/_C*.so an earlier call built; its JIT cache seeded from
# .dg/jit-cache (bench/on_device.sh returns it in $OUT/dg-jit-cache).

_root=$(pwd)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [[ -f .dg/deepgemm.tgz ]]; then
  rm -rf /tmp/deepgemm && tar xzf .dg/deepgemm.tgz -C /tmp
  if ls .dg/_C*.so >/dev/null 2>&1; then
    cp .dg/_C*.so /tmp/deepgemm/deep_gemm/
    cp -r /tmp/deepgemm/third-party/cutlass/include/{cute,cutlass} /tmp/deepgemm/deep_gemm/include/
  else
    python3 hack/build-deepgemm.py /tmp/deepgemm
  fi
  mkdir -p /tmp/dg-jit-cache && { [[ -d .dg/jit-cache ]] && cp -r .dg/jit-cache/. /tmp/dg-jit-cache/ || true; }
  export DG_JIT_CACHE_DIR=/tmp/dg-jit-cache
  export PYTHONPATH=/tmp/deepgemm${PYTHONPATH:+:$PYTHONPATH}
fi
mkdir -p /tmp/shim/specdeploy
for f in "$_root"/specdeploy/*.py; do ln -sf "$f" /tmp/shim/specdeploy/; done
ln -sfn "$_root/engine" /tmp/shim/specdeploy/engine
ln -sfn "$_root/operator" /tmp/shim/specdeploy/operator
ln -sfn "$_root/localcluster" /tmp/shim/specdeploy/localcluster
export PYTHONPATH=/tmp/shim${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
