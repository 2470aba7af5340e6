# Sourced by the GPU scripts from the repository root: where the machine has no package index,
# install the pure-Python wheels of .whl/ (../shared/gpu/wheels.sh .whl, plus pytest-xdist and
# execnet for -n) beside its own torch, and put them and this checkout on PYTHONPATH.
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
