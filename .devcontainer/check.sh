#!/usr/bin/env bash
# Build the dev container's image and run the course in it: the parts a Mac cannot run
# (notebook 06's Triton half, exercise 06's solution in Triton's interpreter), the tour, and
# the quick test tier. Needs Docker (a running daemon) and network access for the packages.
#
#   bash .devcontainer/check.sh            # build, then those checks (about 10 minutes)
#   bash .devcontainer/check.sh --full     # build, then the whole suite, as CI (about 25 minutes)
#
# The container works on a copy of this working tree (your .venv left out), so nothing it
# installs or writes lands in your checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! docker info >/dev/null 2>&1; then
  echo "check.sh: no Docker daemon here (docker info fails): the dev container cannot be built" >&2
  exit 2
fi
image=microvllm-devcontainer
docker build -f .devcontainer/Dockerfile -t "$image" .
if [ "${1:-}" = "--full" ]; then
  tests='bash .ci/run'
else
  tests='python -m pytest notebooks/00_tour.ipynb notebooks/06_attention.ipynb solutions/06_decode_kernel.ipynb && bash .ci/run --quick'
fi
# .venv -> the image's /opt/venv, so that .ci/run finds everything installed already.
docker run --rm -v "$PWD":/src:ro "$image" bash -c "set -e
  mkdir /workspace && tar -C /src --exclude=./.venv -cf - . | tar -C /workspace -xf -
  cd /workspace && ln -s /opt/venv .venv
  bash .devcontainer/post-create.sh
  $tests"
