#!/usr/bin/env bash
# Run once when the dev container is created, in the repository's root.
set -euo pipefail
pip install --no-deps -e .
# Convert the embedded model and compile the CPU kernels now, not in the first notebook.
microvllm generate "The capital of France is" --max-tokens 8
echo "Ready. Open notebooks/00_tour.ipynb (VS Code), or run: jupyter lab --ip 0.0.0.0 --no-browser"
