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
# (--output, kohya's --output_dir, or a config holding one), else a new build/run-DATE-TIME
# (a missing config also counts as naming one: lorapipe says what is wrong with it);
# a folder of the user's is never removed (a folder belongs to one run: `build/bin/lorapipe
# resume DIR` continues it).
if [[ $# -eq 0 ]]; then
  rm -rf build/run
  exec build/bin/lorapipe run --output=build/run
fi
# A config names the folder when it holds `output` (lorapipe's) or `output_dir` (kohya's).
names_folder() {
  [[ ! -f $1 ]] || grep -Eq '^[[:space:]]*(output|output_dir)[[:space:]]*=' "$1"
}
named=0
previous=
for arg in "$@"; do
  case ${arg} in
    --output=* | --output_dir=*) named=1 ;;
    --config=* | --config_file=*) names_folder "${arg#*=}" && named=1 ;;
  esac
  case ${previous} in
    --output | --output_dir) named=1 ;;
    --config | --config_file) names_folder "${arg}" && named=1 ;;
  esac
  previous=${arg}
done
if [[ ${named} -eq 1 ]]; then
  exec build/bin/lorapipe run "$@"
fi
output=build/run-$(date +%Y%m%d-%H%M%S)
echo "run.sh: the run folder is ${output}"
exec build/bin/lorapipe run "--output=${output}" "$@"
