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
# user's shared cache (a second run finds everything cached), then the trainer, which leaves a
# LoRA in build/run/lora/. Flags given to ./run.sh go to preprocess.
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
build/bin/lorapipe-preprocess --data_dir="${demo_dir}" --dataset_id=demo --resolution=128 \
  --min_bucket_reso=64 --max_bucket_reso=256 --push="${pull}" --request="${rep}" "$@"
wait "${cacher_pid}"
trap - EXIT

echo
echo "== trainer: a rank-8 LoRA on the cached demo dataset; the sampler renders its checkpoints =="
prompts="${run_dir}/prompts.txt"
mkdir -p "${run_dir}"
cat >"${prompts}" <<'PROMPTS'
# kohya's prompt syntax: --n negative, --w/--h size, --d seed, --s steps, --l CFG, --ss sampler
a photo of a red circle --w 128 --h 128 --d 1 --s 20
a photo of a blue square --n blurry --w 128 --h 128 --d 2 --s 20 --ss euler_a
PROMPTS
trainer_pub="ipc://${run_dir}/trainer-pub.sock"
build/bin/lorapipe-sampler --pretrained_model_name_or_path="${model_dir}/tiny-sd15.safetensors" \
  --tokenizer="${model_dir}/tiny-sd15-tokenizer" --sample_prompts="${prompts}" \
  --output_dir="${run_dir}" --sub="${trainer_pub}" --idle_timeout_s=300 --device=cpu &
sampler_pid=$!
trap 'kill "${sampler_pid}" 2>/dev/null || true' EXIT
build/bin/lorapipe-trainer --pretrained_model_name_or_path="${model_dir}/tiny-sd15.safetensors" \
  --tokenizer="${model_dir}/tiny-sd15-tokenizer" --dataset_id=demo --output_dir="${run_dir}" \
  --output_name=demo --max_train_steps=100 --train_batch_size=4 --network_dim=8 \
  --network_alpha=8 --learning_rate=1e-3 --lr_scheduler=cosine --lr_warmup_steps=0.05 \
  --validation_split=0.2 --save_every_n_steps=50 --save_state --device=cpu --pub="${trainer_pub}"
wait "${sampler_pid}"
trap - EXIT
echo
echo "The LoRA is ${run_dir}/lora/demo.safetensors; samples and the gallery (index.html) are in"
echo "${run_dir}/samples; TensorBoard events are in ${run_dir}/tensorboard."
echo "The lorapipe launcher comes next."
