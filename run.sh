#!/usr/bin/env bash
# Installs what is missing (not the test-only packages), builds, and runs
# `build/bin/lorapipe run` with the given flags (see the run folder below); with none, the whole
# pipeline on the built-in tiny model and the demo dataset.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/deps.sh

lorapipe_install_apt
lorapipe_ensure_venv
lorapipe_build

# With no flags: the demo, in build/run, made afresh each time. With flags: the folder they name
# (--output, kohya's --output_dir, or a config holding one), else a new build/run-DATE-TIME;
# a folder of the user's is never removed (a folder belongs to one run: `build/bin/lorapipe
# resume DIR` continues it).
if [[ $# -eq 0 ]]; then
  rm -rf build/run
  exec build/bin/lorapipe run --output=build/run
fi
named=0
for arg in "$@"; do
  case ${arg} in
    --output | --output=* | --output_dir | --output_dir=* | --config | --config=* | \
      --config_file | --config_file=*) named=1 ;;
  esac
done
if [[ ${named} -eq 1 ]]; then
  exec build/bin/lorapipe run "$@"
fi
output=build/run-$(date +%Y%m%d-%H%M%S)
echo "run.sh: the run folder is ${output}"
exec build/bin/lorapipe run "--output=${output}" "$@"
