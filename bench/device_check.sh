#!/usr/bin/env bash
# The one script to run on a machine with a CUDA GPU: the environment, the GPU tests, the PTX hardware check,
# the patterns', packed sequences' and pages' GPU tests (mods, block masks, sinks, attention_varlen,
# attention_paged), the demo, a short benchmark sweep, the backward beside torch's, the patterns as functions
# beside dense arrays (bench.patterns on CuPy arrays), packed against padded and paged decoding against gathered
# pages (bench.sequences: tokens per second and the share of HBM bandwidth), ncu's DRAM bytes beside
# the model, and ncu's shared-memory wavefronts, bank conflicts, global sectors and barriers beside the emulator's
# profile of the same forward kernels (n = m = 128, d = 64). Each step has a time limit and the whole stays under
# 10 minutes; a failing step does not stop the others.
#
#   bench/device_check.sh [DIR]             # everything into DIR (default bench/results/gpu, rewritten in place)
#   bench/device_check.sh --dry-run [DIR]   # print the steps and their limits, run nothing
#
# DIR/summary.md lists each step's exit code, seconds and log (124: it ran out of time). The script installs
# nothing and needs no network: cuflash runs from this checkout through PYTHONPATH. PYTHON picks the
# interpreter (default python3); DEVICE_CHECK_BUDGET_S the total seconds (default 595). Without a GPU it
# stops with exit code 2, unless DEVICE_CHECK_ANYWAY=1 (to try this script itself on a CPU).
set -u

ORIG=$(pwd)
cd "$(dirname "$0")/.." || exit 1
REPO=$(pwd)
DRY=0
case "${1:-}" in
    --dry-run) DRY=1; shift ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
esac
DIR=${1:-$REPO/bench/results/gpu}
case $DIR in /*) ;; *) DIR=$ORIG/$DIR ;; esac
PY=${PYTHON:-python3}
BUDGET=${DEVICE_CHECK_BUDGET_S:-595}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
HARDWARE_TEST=tests/simt/test_hardware.py

ROWS=()   # summary rows: step | exit | seconds | log | note
NOTES=()
FAILED=0

note() { echo "NOTE: $*"; NOTES+=("$*"); }

record() {  # record STEP EXIT SECONDS NOTE
    ROWS+=("| $1 | $2 | $3 | $( [ -f "$DIR/$1.log" ] && echo "$1.log" ) | $4 |")
    [ "$2" = 0 ] || [ "$2" = - ] || FAILED=1
}

step() {  # step NAME SECONDS COMMAND...: run it with a time limit, log to DIR/NAME.log, record its exit code
    local name=$1 limit=$2; shift 2
    if [ "$DRY" = 1 ]; then printf '  %-14s %4ss  %s\n' "$name" "$limit" "$*"; return; fi
    local left=$((BUDGET - SECONDS))
    if [ "$left" -lt 20 ]; then record "$name" - 0 "skipped: the ${BUDGET} s budget is spent"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo; echo "== $name (at most ${limit} s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$DIR/$name.log"
    local rc=${PIPESTATUS[0]} why=""
    case $rc in
        124|137) why="ran out of its ${limit} s" ;;
        5) [[ $name == tests* ]] && why="pytest collected no tests" ;;
    esac
    # pytest's last line counts what passed, failed and was skipped; a failing step's last line says why
    if [[ $name == tests* ]] || [ "$rc" != 0 ]; then
        why="${why:+$why; }$(grep -v '^[[:space:]]*$' "$DIR/$name.log" | tail -n 1 | tr -d '|' | cut -c 1-200)"
    fi
    record "$name" "$rc" $((SECONDS - start)) "$why"
}

environment() {  # what the machine is: GPU, driver, toolkit and Python packages
    nvidia-smi
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv
    nvcc --version
    ncu --version
    compute-sanitizer --version
    "$PY" - <<'EOF'
import importlib, platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("numpy", "cupy", "torch", "ml_dtypes", "pytest", "hypothesis", "matplotlib", "triton"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as exc:
        print(name, "MISSING:", type(exc).__name__, exc)
try:
    import cupy
    rt = cupy.cuda.runtime
    print("cupy sees", rt.getDeviceCount(), "device(s); CUDA runtime", rt.runtimeGetVersion(),
          "driver", rt.driverGetVersion())
    cupy.show_config()
except Exception as exc:
    print("cupy: no device:", type(exc).__name__, exc)
try:
    import torch
    print("torch CUDA", torch.version.cuda, "cuDNN", torch.backends.cudnn.version(),
          "available", torch.cuda.is_available())
except Exception as exc:
    print("torch:", type(exc).__name__, exc)
EOF
}

export -f environment
export PY
has() { "$PY" -c "import $1" >/dev/null 2>&1; }

# What the steps need that may be missing on a borrowed machine: say so loudly, install nothing.
PYTEST_ARGS=(-q -p no:cacheprovider -m gpu)
if [ "$DRY" = 0 ]; then
    has ml_dtypes || note "ml_dtypes is MISSING: cuflash imports it, so the tests, the demo and cuflash's" \
        "benchmark rows fail; bring its wheel"
    has pytest || note "pytest is MISSING: the test steps fail at once; bring its wheel"
    if ! has hypothesis; then
        note "hypothesis is MISSING: tests/conftest.py imports it, so pytest runs with --noconftest and" \
            "--continue-on-collection-errors: the test files that import hypothesis are not collected (their" \
            "errors are in the logs); the others run"
        PYTEST_ARGS+=(--noconftest --continue-on-collection-errors)
    fi
    # NVRTC compiles each kernel instantiation the tests meet on first use (a second or more each, one at a
    # time per process): with pytest-xdist the test files compile in parallel.
    has xdist && PYTEST_ARGS+=(-n 6)
fi

steps() {
    step env 25 bash -c environment
    step tests 120 "$PY" -m pytest "${PYTEST_ARGS[@]}" --ignore="$HARDWARE_TEST" --junitxml="$DIR/tests.xml" tests
    if [ -f "$HARDWARE_TEST" ] || [ "$DRY" = 1 ]; then
        step tests-ptx 30 "$PY" -m pytest "${PYTEST_ARGS[@]}" --junitxml="$DIR/tests-ptx.xml" "$HARDWARE_TEST"
    else
        record tests-ptx - 0 "skipped: $HARDWARE_TEST does not exist yet"
    fi
    # the patterns', packed sequences' and pages' GPU tests again on their own: they run even where the whole GPU
    # suite ran out of its time
    step tests-patterns 45 "$PY" -m pytest "${PYTEST_ARGS[@]}" \
        -k "mod or pattern or block_mask or sink or varlen or paged or packed" \
        --junitxml="$DIR/tests-patterns.xml" tests
    step demo 30 "$PY" -m cuflash
    step sweep 80 "$PY" -m bench.attention --preset short --time-limit 50 --out "$DIR/sweep"
    step backward 60 "$PY" -m bench.backward --gpu --repeats 5 --out "$DIR/backward"
    step patterns 65 "$PY" -m bench.patterns --backend cupy --dtype float16 --n 4096 --out "$DIR/patterns"
    step sequences 35 "$PY" -m bench.sequences --gpu --out "$DIR/sequences"
    step ncu 60 "$PY" -m bench.attention --ncu --ncu-timeout 25 --out "$DIR/ncu"
    if command -v ncu >/dev/null 2>&1 || [ "$DRY" = 1 ]; then
        step profile 50 "$PY" -m bench.emulator_profile --ncu "$DIR/profile" --ncu-timeout 30
    else
        record profile - 0 "skipped: ncu is not on PATH (python -m bench.emulator_profile gives the emulator's side)"
    fi
}

if [ "$DRY" = 1 ]; then
    echo "device check into $DIR, at most $BUDGET s in all (PYTHONPATH=$REPO); steps and their limits:"
    steps
    exit 0
fi

mkdir -p "$DIR" || exit 1
echo "device check into $DIR, at most $BUDGET s"
COUNT_GPUS="import cupy, sys; sys.exit(cupy.cuda.runtime.getDeviceCount() < 1)"
if [ "${DEVICE_CHECK_ANYWAY:-0}" != 1 ] && ! nvidia-smi -L >/dev/null 2>&1 && \
        ! "$PY" -c "$COUNT_GPUS" >/dev/null 2>&1; then
    note "no CUDA GPU here (nvidia-smi and CuPy see none): nothing was run; on a CPU use" \
        "python -m bench.attention --tiny"
    NO_GPU=1
else
    NO_GPU=0
    steps
fi

{
    echo "# Device check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    echo "- command: \`bench/device_check.sh ${DIR#"$REPO"/}\`"
    echo "- commit: $(git -C "$REPO" rev-parse HEAD 2>/dev/null || echo unknown)"
    echo "- GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
    echo "- total: ${SECONDS} s of a ${BUDGET} s budget"
    echo
    echo "| step | exit | seconds | log | note |"
    echo "|---|---|---|---|---|"
    for row in "${ROWS[@]+"${ROWS[@]}"}"; do echo "$row"; done
    if [ "${#NOTES[@]}" -gt 0 ]; then
        echo
        for n in "${NOTES[@]}"; do echo "- NOTE: $n"; done
    fi
    [ -f "$DIR/ncu/ncu.md" ] && { echo; cat "$DIR/ncu/ncu.md"; }
    [ -f "$DIR/profile/profile.md" ] && { echo; cat "$DIR/profile/profile.md"; }
} > "$DIR/summary.md"
echo; cat "$DIR/summary.md"

[ "$NO_GPU" = 1 ] && exit 2
exit "$FAILED"
