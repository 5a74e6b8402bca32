#!/usr/bin/env bash
# Build an earlier commit's AdamW as a standalone file for `python -m benchmarks optimizer --baseline FILE`:
# its opsmath_compiler/optim.py and kernels/ (the layout before src/opsmath), imports made local.
#   benchmarks/adamw_baseline.sh [COMMIT=4c6de9c]   -> build/adamw_baseline/optim_COMMIT.py
set -euo pipefail
commit="${1:-4c6de9c}"
out=build/adamw_baseline
rm -rf "$out" && mkdir -p "$out/baseline_kernels"
for f in _spec _common adamw adamw_8bit autotune; do git show "$commit:kernels/$f.py" > "$out/baseline_kernels/$f.py"; done
touch "$out/baseline_kernels/__init__.py"
git show "$commit:opsmath_compiler/optim.py" \
  | sed -e 's/from opsmath.kernels import adamw_8bit as q8/from baseline_kernels import adamw_8bit as q8/' \
        -e 's/from opsmath.kernels\./from baseline_kernels./' \
        -e '0,/^import torch/s//import os, sys\nsys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))\nimport torch/' \
  > "$out/optim_$commit.py"
echo "$out/optim_$commit.py"
