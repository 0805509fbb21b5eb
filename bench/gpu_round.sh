#!/usr/bin/env bash
# One GPU round in one call: device and versions, the test suite, the README's main command,
# the benchmarks with their JSON, and the charts, all under one output folder.
#
#   bench/gpu_round.sh [OUTPUT_DIR]        # default: $OUT, else bench/results/gpu-<UTC time>
#
# Needs python3 with torch, triton, cupy, pytest, pytest-xdist, pytest-timeout and
# pytest-benchmark (and matplotlib for the charts); no network. Runs from the repository root
# with PYTHONPATH=. so that the checkout is what runs. A failing step does not stop the later
# ones; the summary at the end lists every step's exit status and log, and the script exits
# non-zero when any step failed. Commit the folder under bench/results/.
#
# Environment: FASTCOMM_ROUND_WORKERS (pytest-xdist workers, default 8),
# FASTCOMM_ROUND_STEP_TIMEOUT (seconds per step, default 5400), FASTCOMM_ROUND_STEPS (names of
# the steps to run, e.g. "versions train"; default all: versions pip-freeze tests train
# train-cuda bench-ddp-gpu bench-ddp-compile bench-kernels bench-ddp bench-compression
# bench-collectives charts).

set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
WORKERS="${FASTCOMM_ROUND_WORKERS:-8}"
STEP_TIMEOUT="${FASTCOMM_ROUND_STEP_TIMEOUT:-5400}"
ONLY="${FASTCOMM_ROUND_STEPS:-}"
DEST="${1:-${OUT:-bench/results/gpu-$(date -u +%Y%m%d-%H%M%S)}}"
mkdir -p "$DEST" || exit 2
DEST="$(cd "$DEST" && pwd)"

NAMES=()
CODES=()
SECONDS_TAKEN=()

# step NAME COMMAND...: runs COMMAND with its output in $DEST/NAME.log, records its exit status
step() {
    local name="$1"
    shift
    if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then
        return 0
    fi
    local log="$DEST/$name.log"
    local start=$SECONDS
    echo "=== $name: $*" | tee "$log"
    if declare -F "$1" >/dev/null; then  # a function of this script: timeout cannot run it
        "$@" >>"$log" 2>&1
    else
        timeout --kill-after=60 "$STEP_TIMEOUT" "$@" >>"$log" 2>&1
    fi
    local rc=$?
    NAMES+=("$name")
    CODES+=("$rc")
    SECONDS_TAKEN+=("$((SECONDS - start))")
    echo "=== $name: exit $rc after $((SECONDS - start)) s (log: $log)"
    tail -n 3 "$log"
    return 0
}

versions() {
    "$PY" - "$DEST/versions.json" <<'EOF'
import datetime
import json
import platform
import subprocess
import sys


def attempt(fn):
    try:
        return fn()
    except Exception as exc:  # record why a version is missing instead of failing the round
        return f"unavailable: {type(exc).__name__}: {exc}"


def torch_info():
    import torch

    info = {
        "version": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "nccl_bundled": attempt(lambda: ".".join(map(str, torch.cuda.nccl.version()))),
    }
    info["devices"] = [
        {
            "name": torch.cuda.get_device_name(i),
            "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
            "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1),
        }
        for i in range(info["device_count"])
    ]
    return info


def cupy_info():
    import cupy

    return {
        "version": cupy.__version__,
        "cuda_runtime": attempt(lambda: cupy.cuda.runtime.runtimeGetVersion()),
    }


def nccl_loaded():
    from fastcomm.comm.world import detected_nccl_version

    version = detected_nccl_version()
    return None if version is None else ".".join(map(str, version))


def nvidia_smi():
    query = "name,driver_version,memory.total,pci.bus_id,compute_cap"
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    topo = subprocess.run(
        ["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=60
    ).stdout
    return {"gpus": [line.strip() for line in out.splitlines() if line.strip()], "topo": topo}


report = {
    "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "host": platform.node(),
    "platform": platform.platform(),
    "python": sys.version.split()[0],
    "nvidia_smi": attempt(nvidia_smi),
    "torch": attempt(torch_info),
    "triton": attempt(lambda: __import__("triton").__version__),
    "cupy": attempt(cupy_info),
    "nccl_loaded_by_cupy": attempt(nccl_loaded),
    "fastcomm_commit": attempt(
        lambda: subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    ),
}
with open(sys.argv[1], "w") as f:
    json.dump(report, f, indent=2)
print(json.dumps(report, indent=2))
EOF
}

step versions versions
step pip-freeze "$PY" -m pip freeze
step tests "$PY" -m pytest -q -n "$WORKERS" tests -p no:cacheprovider \
    --junitxml="$DEST/tests-junit.xml"
# the README's main command (fastcomm-run is `python3 -m fastcomm.launch` without installing)
step train "$PY" -m fastcomm.launch --nproc-per-node 2 examples/train.py --no-progress
step train-cuda "$PY" -m fastcomm.launch --nproc-per-node 2 examples/train.py --no-progress \
    --device cuda
for bench in ddp_gpu ddp_compile kernels ddp compression collectives; do
    step "bench-${bench//_/-}" "$PY" -m pytest -q -s "bench/test_$bench.py" -p no:cacheprovider \
        --benchmark-json="$DEST/bench-${bench//_/-}.json"
done
charts=()
for json in "$DEST"/bench-*.json; do
    [ -s "$json" ] && charts+=("$json")
done
if [ "${#charts[@]}" -gt 0 ]; then
    step charts "$PY" bench/plot.py "${charts[@]}" --out "$DEST"
else
    step charts false  # no benchmark wrote its JSON: nothing to chart
fi

echo
echo "=== summary ($DEST)"
failed=0
for i in "${!NAMES[@]}"; do
    status="ok"
    if [ "${CODES[$i]}" -ne 0 ]; then
        status="FAILED (exit ${CODES[$i]})"
        failed=$((failed + 1))
    fi
    printf '%-20s %-18s %6s s  %s\n' "${NAMES[$i]}" "$status" "${SECONDS_TAKEN[$i]}" \
        "$DEST/${NAMES[$i]}.log"
done
grep -E '[0-9]+ (passed|failed)' "$DEST/tests.log" 2>/dev/null | tail -n 1
echo "$failed of ${#NAMES[@]} steps failed"
[ "$failed" -eq 0 ]
