#!/usr/bin/env bash
# The CUDA tier on a GPU machine, with the packages it has (no install, no network; expecttest is not needed):
#   bash tests/cuda/run_tier.sh OUT_DIR
# runs every test marked `cuda` (tests/cuda, fastest first) plus the torch-fix tests of the attention kernels, from the
# repository root, and writes OUT_DIR/summary.txt (GPU, torch, transformers, pytest's outcome per test) and
# OUT_DIR/junit.xml. Exit status: pytest's.
set -uo pipefail
out=${1:?usage: tests/cuda/run_tier.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    python -c 'import sys, torch, transformers; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'
    python -c 'import dtensor_ext, collections; print("registry", dict(collections.Counter(e.status for e in dtensor_ext.registry())))'
} > "$out/summary.txt" 2>&1
# -v: each outcome is written as it happens, so a run stopped by the time limit still reports what it reached;
# with pytest-xdist, workers in processes of their own: a kernel that kills its process fails one test, not the tier
workers=$(python -c 'import xdist' 2>/dev/null && echo "-n ${TIER_WORKERS:-6}")
timeout "${TIER_TIMEOUT:-460}" python -m pytest $workers tests/torch_fixes/test_attention_mask.py tests/torch_fixes/test_attention_empty_shards.py \
    tests/torch_fixes/test_attention_bias.py tests/torch_fixes/test_mask_partial_views.py tests/cuda/test_attention.py \
    tests/cuda/test_grouped_mm.py tests/cuda/test_compile.py tests/cuda/test_program_compile.py tests/cuda/test_zoo.py -v -rfEsxX -s \
    -p no:cacheprovider --timeout 200 --tb=short --junitxml "$out/junit.xml" > "$out/pytest.txt" 2>&1
status=$?
grep -E " (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)|passed|failed" "$out/pytest.txt" >> "$out/summary.txt"
tail -n 1 "$out/pytest.txt"
exit $status
