#!/usr/bin/env bash
# Installs what is missing (not the test-only packages), builds, and runs
# `build/bin/lorapipe run` with the given flags (run folder build/run unless given); with none,
# the whole pipeline on the built-in tiny model and the demo dataset.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/deps.sh

lorapipe_install_apt
lorapipe_ensure_venv
lorapipe_build

# The run folder is build/run, made afresh each time, unless a flag names another (a folder
# belongs to one run: `build/bin/lorapipe resume DIR` continues it).
output=(--output=build/run)
for arg in "$@"; do
  [[ ${arg} == --output=* || ${arg} == --output_dir=* || ${arg} == --config=* ]] && output=()
done
[[ ${#output[@]} -eq 0 ]] || rm -rf build/run
exec build/bin/lorapipe run "${output[@]}" "$@"
