#!/usr/bin/env bash
# The GPU-box bench in two halves (bench/gpubox.py says what it measures):
#   bash bench/gpubox.sh pack    here, with network: snap's wheel, its dependencies' wheels for the box's
#                                Python, Debian's docker-registry and zstd, all into .gpubox/ (ignored)
#   bash bench/gpubox.sh run     there, no network: unpacks the wheels with the box's own Python (no venv,
#                                so moving the box's venv aside cannot break snap) and runs the bench
# On the device tool: run(command="bash bench/gpubox.sh run", carry=[".gpubox"], timeout_s=600).
# Sizes: GPUBOX_VENV (/opt/torch/.venv), GPUBOX_WEIGHT_GIB (4), GPUBOX_PYTHON (python3.12), PYVER (3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
PACK=.gpubox
PYVER="${PYVER:-3.12}"

pack() {
  rm -rf "$PACK" && mkdir -p "$PACK/wheels" "$PACK/bin" "$PACK/libexec" "$PACK/lib"
  local py=".venv/bin/python"
  [ -x "$py" ] || py=python3
  "$py" -m pip wheel -q --no-deps -w "$PACK/wheels" .
  mapfile -t deps < <("$py" -c '
import re, zipfile, glob
w = zipfile.ZipFile(glob.glob(".gpubox/wheels/*.whl")[0])
meta = next(n for n in w.namelist() if n.endswith(".dist-info/METADATA"))
for line in w.read(meta).decode().splitlines():
    if line.startswith("Requires-Dist:") and "extra ==" not in line:
        print(line.split(":", 1)[1].split(";")[0].strip())')
  "$py" -m pip download -q --only-binary=:all: --python-version "$PYVER" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$PACK/wheels" "${deps[@]}"
  cp /usr/bin/docker-registry "$PACK/bin/"
  cp /usr/bin/zstd "$PACK/libexec/"
  for lib in $(ldd /usr/bin/zstd | awk '/=> \// {print $3}' | grep -v 'libc.so'); do cp -L "$lib" "$PACK/lib/"; done
  du -sh "$PACK"
}

run() {
  local py="${GPUBOX_PYTHON:-python$PYVER}" site=/tmp/snap-gpubox-site
  rm -rf "$site"
  "$py" -c 'import sys, zipfile, glob
for w in glob.glob(".gpubox/wheels/*.whl"):
    zipfile.ZipFile(w).extractall(sys.argv[1])' "$site"
  export PATH="$PWD/$PACK/bin:$PATH" PYTHONPATH="$site" PYTHONUNBUFFERED=1
  if ! command -v zstd >/dev/null; then  # Debian's, with the libraries it was linked with
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$PWD/$PACK/lib" "$PWD/$PACK/libexec/zstd" >"$PACK/bin/zstd"
    chmod +x "$PACK/bin/zstd"
  fi
  nproc; free -g | head -2; df -h / /dev/shm | tail -2
  # Run from outside the checkout: from its root, `python -m snapshotter` would import the source tree
  # (where the profiles are not yet snapshotter/layers) instead of the unpacked wheel.
  local repo="$PWD"
  cd /
  "$py" -m snapshotter --help >/dev/null
  "$py" "$repo/bench/gpubox.py" --venv "${GPUBOX_VENV:-/opt/torch/.venv}" --weight-gib "${GPUBOX_WEIGHT_GIB:-4}" \
    --out "${OUT:-$repo/bench/out}"
}

case "${1:-}" in
  pack) pack ;;
  run) run ;;
  *) echo "usage: bash bench/gpubox.sh pack|run" >&2; exit 2 ;;
esac
