#!/usr/bin/env bash
# The wheels the device_*.sh scripts install on the lent host (Python 3.12, no index there) into .whl/: DeepSpeed
# 0.19.8 built without its ops (py3-none-any), and the cp312 manylinux wheels of what the host's image lacks (isal,
# hjson, pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions) plus ml_dtypes as the
# index serves it. Run here, from the repo root, before a call that carries .whl: `bash benchmarks/device_wheels.sh`
# (about 6 MB; megatron-core's wheel for the meta step: add MCORE=1).
set -euo pipefail
py=  # PY312 or any Python 3.12 that runs (a pyenv shim may name one that does not)
for c in ${PY312:-} python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python; do
  "$c" -c "import sys; assert sys.version_info[:2] == (3, 12)" 2>/dev/null && { py=$c; break; }; done
[ -n "$py" ] || { echo "no Python 3.12 here: set PY312" >&2; exit 2; }
mkdir -p .whl
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d .whl isal hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions ml_dtypes
[ "${MCORE:-0}" = 1 ] && "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl megatron-core
ls .whl/deepspeed-0.19.8-*.whl >/dev/null 2>&1 || DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps deepspeed==0.19.8 -w .whl
ls -1 .whl; du -sh .whl
