#!/usr/bin/env bash
# Prepare the GPU check's carried wheels on a CPU machine with network, then print the device call.
#
#   tools/gpu_check_device.sh [GPU_CHECK_FLAGS...]      (default: --part all)
#
# Downloads (pip download --no-deps, for the GPU image's Python 3.12 on x86-64) each wheel listed in
# tools/gpu_check_lib/wheels.txt into wheels/ (git-ignored, so it travels only when a `run` call
# carries it), removes wheels no longer listed, checks that the tree plus wheels/ stay within the
# 64 MiB a device call takes, and prints the `run` call to make: its command, carry list and
# timeout. Installs nothing here. User guide: docs/gpu-check.md.
set -euo pipefail
cd "$(dirname "$0")/.."
LIST=tools/gpu_check_lib/wheels.txt
WHEELS=wheels
PY=${PYTHON:-python3}
LIMIT_MIB=64
[ $# -gt 0 ] || set -- --part all

mkdir -p "$WHEELS"
git check-ignore -q "$WHEELS/" || { echo "error: $WHEELS/ is not git-ignored (add it to .gitignore)" >&2; exit 2; }
specs=$(sed -e 's/#.*//' "$LIST" | awk 'NF {print $1}')
keep=()
for spec in $specs; do
  name=${spec%%==*} version=${spec##*==}
  stem="$(echo "$name" | tr '-' '_')-$version-"
  keep+=("$stem")
  if ! compgen -G "$WHEELS/$stem*.whl" > /dev/null; then
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$WHEELS" "$spec"
  fi
done
for wheel in "$WHEELS"/*.whl; do
  base=$(basename "$wheel") listed=0
  for stem in "${keep[@]}"; do [[ $base == "$stem"* ]] && listed=1; done
  [ $listed = 1 ] || { echo "removing $base (not in $LIST)"; rm -f "$wheel"; }
done

tree_kib=$(git ls-files -z --cached --others --exclude-standard | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
wheels_kib=$(du -sk "$WHEELS" | cut -f1)
total_mib=$(( (tree_kib + wheels_kib) / 1024 ))
echo "wheels/: $(ls "$WHEELS"/*.whl | wc -l) wheels, $((wheels_kib / 1024)) MiB; working tree $((tree_kib / 1024)) MiB; together ${total_mib} MiB of ${LIMIT_MIB}"
[ "$total_mib" -le "$LIMIT_MIB" ] || { echo "error: the tree and wheels/ are ${total_mib} MiB, over the ${LIMIT_MIB} MiB a device call takes" >&2; exit 2; }

cat <<CALL

Device call (the device tool's run verb):
  command: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHEELS/*.whl && export PYTHONPATH=/tmp/site:\$PWD PYTHONUNBUFFERED=1 && set -o pipefail && python3 tools/gpu_check.py $* --out \$OUT/gpu_check 2>&1 | tee \$OUT/log
  carry: ["$WHEELS"]
  timeout_s: 600
Then commit \$OUT/gpu_check/report.json and report.md as docs/gpu-results/<date>-<device>.json and .md.
CALL
