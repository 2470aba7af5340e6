# Sourced by the GPU scripts from the repository root: where the machine has no package index,
# install the pure-Python wheels of .whl/ (../shared/gpu/wheels.sh .whl, plus pytest-xdist and
# execnet for -n) beside its own torch, and put them and this checkout on PYTHONPATH.
# Installed once per machine: a second `pip install --upgrade --target` over a folder another
# run had filled left pydantic unimportable on the H200 host, so a later call on a warm machine
# reuses the folder where it holds the same wheels.
if [ -d .whl ]; then
  stamp=$(ls .whl | sha1sum | cut -c1-16)
  if [ "$(cat /tmp/site/.opprof-wheels 2>/dev/null)" != "$stamp" ]; then
    rm -rf /tmp/site.new
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/site.new .whl/*.whl || exit 1
    echo "$stamp" > /tmp/site.new/.opprof-wheels
    rm -rf /tmp/site && mv /tmp/site.new /tmp/site
  fi
  export PYTHONPATH=/tmp/site:$PWD
fi
