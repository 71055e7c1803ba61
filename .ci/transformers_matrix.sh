#!/usr/bin/env bash
# Run lessmem's transformers-facing tests against one given transformers version.
#
#   .ci/transformers_matrix.sh 5.24.0          # the newest the registry serves today
#   .ci/transformers_matrix.sh 5.13.0          # the oldest that passes (2026-12-01)
#   .ci/transformers_matrix.sh 5.13.0 -k cache # extra arguments go to pytest
#
# Checked 2026-12-01: 5.24.0 and 5.13.0 pass; 5.0.0 and 4.56.0 (the floor pyproject.toml
# names) fail when run, and 5.12.1 must by its source: their cache layers must define
# get_max_cache_shape (later releases ask get_max_length instead); 4.56 also passes
# get_mask_sizes a cache_position tensor and has no fp8 QuantizedCache backend.
#
# It makes a virtual environment under ${MATRIX_DIR:-/tmp/lessmem-tf-matrix}/<version>
# that sees this machine's packages (--system-site-packages: torch, numpy, pytest, ...
# are not downloaded again), installs only the requested transformers into it (pip
# also pulls the tokenizers / huggingface_hub that version needs, inside the venv
# only), puts this checkout's src/ first on the path, and runs the tests that drive
# real transformers models through lessmem's caches: the KV cache, the evaluator and
# the cache-keyword check. Versions: `pip index versions transformers`.
set -euo pipefail
if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "usage: $0 TRANSFORMERS_VERSION [pytest args...]" >&2
  exit 2
fi
version="$1"
shift
if ! [[ "$version" =~ ^[0-9]+(\.[0-9]+)*([a-z]+[0-9]*)?$ ]]; then
  echo "$0: version '$version' is not a version number like 4.56.0" >&2
  exit 2
fi
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${MATRIX_DIR:-/tmp/lessmem-tf-matrix}/$version"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv --system-site-packages "$venv"
fi
# -c pins torch to the build on this machine, so transformers cannot drag in another.
"$venv/bin/python" -m pip install -q -c "$root/.ci/constraints.txt" "transformers==$version"
installed="$("$venv/bin/python" -c 'import transformers; print(transformers.__version__)')"
if [[ "$installed" != "$version" ]]; then
  echo "$0: asked for transformers $version, the venv imports $installed" >&2
  exit 1
fi
echo "transformers $installed in $venv"

cd "$root"
export PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"$venv/bin/python" -m pytest -q -p no:cacheprovider \
  tests/kvcache/test_cache.py \
  tests/eval/test_protocol.py \
  tests/eval/test_caches.py \
  tests/eval/test_passkey.py \
  tests/eval/test_model_e2e.py \
  "$@"
