# Maps Slurm's task environment to the one torchrun sets, which lorapipe-trainer ranks read:
# RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR (the allocation's first node) and MASTER_PORT (from
# the job id, so two jobs on one node do not collide). Sourced by train.sbatch in each task.
# LOCAL_RANK (SLURM_LOCALID) picks the task's GPU, cuda:LOCAL_RANK, so every task must see all of
# its node's GPUs: allocate them with --gpus-per-node, not --gpus-per-task (see train.sbatch).
export RANK="${SLURM_PROCID:?not inside a Slurm task}"
export WORLD_SIZE="${SLURM_NTASKS:?not inside a Slurm task}"
export LOCAL_RANK="${SLURM_LOCALID:-0}"
if [[ -z ${MASTER_ADDR:-} ]]; then
  if command -v scontrol >/dev/null 2>&1; then
    MASTER_ADDR="$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1)"
  else
    MASTER_ADDR="${SLURM_LAUNCH_NODE_IPADDR:?neither scontrol nor SLURM_LAUNCH_NODE_IPADDR}"
  fi
fi
export MASTER_ADDR
export MASTER_PORT="${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}"
