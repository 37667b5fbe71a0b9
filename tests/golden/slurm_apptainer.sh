#!/bin/bash
#SBATCH --job-name=hpctrain-golden
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:a100:4
#SBATCH --cpus-per-task=32
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --chdir=/work/project
#SBATCH --output=/work/project/runs/golden/slurm-%j.out
#SBATCH --error=/work/project/runs/golden/slurm-%j.err

# Written by `hpctrain slurm`; `hpctrain slurm status RUN_DIR` reports on the job.
# On USR1 (the time-limit warning, or `scancel --signal=USR1 --batch`) and on TERM (a grace-time
# preemption, an admin's scancel) the traps below forward the signal to the job step; the ranks
# save and exit 3; only then, and only while fewer than MAX_REQUEUES requeues happened, this shell
# (on the host) runs `scontrol requeue`.
set -u
RUN_DIR=/work/project/runs/golden
MAX_REQUEUES=3
echo "hpctrain: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST at $(date -u +%FT%TZ)"
export SRUN_CPUS_PER_TASK=32  # srun's CPUs per task (22.05-23.02 do not inherit sbatch's)
export OMP_NUM_THREADS=8  # CPUs per rank
export GLOO_SOCKET_IFNAME=ib0
export NCCL_DEBUG=WARN
export NCCL_SOCKET_IFNAME=ib0
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
RDZV_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))  # per job: two jobs on one node never collide

interrupted=0
forward() { interrupted=1; echo "hpctrain: $1 at $(date -u +%FT%TZ), forwarding to the job step"; }
trap 'forward USR1; kill -USR1 "$step" 2>/dev/null' USR1
trap 'forward TERM; scancel --signal=TERM "$SLURM_JOB_ID"' TERM
started=$(date +%s)
srun --nodes=2 --ntasks-per-node=1 --cpus-per-task=32 \
  apptainer exec --nv --bind /work/project,/scratch/datasets --pwd /work/project /images/pytorch.sif \
  python3 -m hpctrain run --nnodes=2 --nproc=4 --rdzv-endpoint="$HEAD_NODE:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID" --shutdown-timeout=300 \
  train data.name=synthetic_tiny model.name=mnist_cnn data.path=/scratch/datasets/mnist-shards run.dir=/work/project/runs/golden &
step=$!
# bash runs a trap only once `wait` returns: wait again until the step itself has ended
wait "$step"; code=$?
while [ "$interrupted" = 1 ]; do interrupted=0; wait "$step"; code=$?; done

status="$RUN_DIR/status.json"; restarts=${SLURM_RESTART_COUNT:-0}; preempted=0
if [ "$code" -eq 3 ]; then preempted=1
# the ranks saved and said so, but the step's own code is srun's (a task killed after the save) or lost (bash's wait, hit by a second signal as the step ended, can return -1): exit 3 all the same
elif [ "$code" -ne 0 ] && [ "$(stat -c %Y "$status" 2>/dev/null || echo 0)" -ge "$started" ] && grep -Eq '"outcome": *"preempted"' "$status"; then preempted=1; code=3; fi
echo "hpctrain: job step exited with $code (preempted=$preempted, restarts=$restarts)"
if [ "$preempted" = 1 ] && [ "$restarts" -lt "$MAX_REQUEUES" ]; then
  echo "hpctrain: requeue $((restarts + 1)) of $MAX_REQUEUES"; scontrol requeue "$SLURM_JOB_ID"
elif [ "$preempted" = 1 ]; then
  echo "hpctrain: preempted after $restarts requeues (--max-requeues $MAX_REQUEUES): not requeued"
fi
exit "$code"
