#!/usr/bin/env bash
# Installs what is missing (not the test-only packages), builds, and runs
# `build/bin/lorapipe run` with the given flags; with none, the main job on the embedded default.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/deps.sh

lorapipe_install_apt
lorapipe_ensure_venv
lorapipe_build

if [[ -x build/bin/lorapipe ]]; then
  exec build/bin/lorapipe run "$@"
fi

# Until the launcher lands, say plainly what exists and what does not.
echo
echo "lorapipe is built, but the pipeline cannot run yet:"
for stage in lorapipe lorapipe-preprocess lorapipe-cacher lorapipe-trainer lorapipe-sampler \
  lorapipe-inspect; do
  if [[ -x build/bin/${stage} ]]; then
    echo "  build/bin/${stage}: built"
  else
    echo "  build/bin/${stage}: not there yet"
  fi
done
echo "What exists today: the wire protocol (proto/) with its tests (./test.sh) and"
echo "its benchmark (build/bin/wire_bench)."
