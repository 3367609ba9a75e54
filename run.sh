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

# Until the launcher lands, run the stages that exist on the embedded default: the demo dataset
# and the tiny SD1.5 model, preprocess and cacher as two processes over ipc://, against the
# user's shared cache. A second run finds everything cached.
demo_dir="${LORAPIPE_DEMO_DIR:-build/demo}"
model_dir="${LORAPIPE_TINY_MODEL_DIR:-build/tiny-model}"
run_dir="build/run"
[[ -d ${demo_dir}/10_shapes ]] || build/bin/lorapipe-demo-dataset "${demo_dir}"
[[ -f ${model_dir}/tiny-sd15.safetensors ]] || build/bin/lorapipe-make-tiny-model "${model_dir}" >/dev/null
mkdir -p "${run_dir}"
pull="ipc://${PWD}/${run_dir}/cacher-pull.sock"
rep="ipc://${PWD}/${run_dir}/cacher-rep.sock"

echo
echo "== preprocess -> cacher on the demo dataset, tiny SD1.5 model =="
build/bin/lorapipe-cacher --model="${model_dir}/tiny-sd15.safetensors" \
  --tokenizer="${model_dir}/tiny-sd15-tokenizer" --pull="${pull}" --rep="${rep}" &
cacher_pid=$!
trap 'kill ${cacher_pid} 2>/dev/null || true' EXIT
build/bin/lorapipe-preprocess --data_dir="${demo_dir}" --push="${pull}" --request="${rep}" "$@"
wait "${cacher_pid}"
trap - EXIT
echo
echo "Training comes next: lorapipe-trainer, lorapipe-sampler and the lorapipe launcher are not"
echo "built yet. Run ./run.sh again: the cacher reports 100% hits and preprocess decodes nothing."
