#!/usr/bin/env bash
# Launch a co2jax pretraining run on a multi-node GPU cluster with SLURM: one process per GPU.
# Usage: sbatch --nodes=4 --gpus-per-node=8 --ntasks-per-node=8 experiments/scripts/gpu_slurm.sh \
#        PRESET DATA [overrides...]
# JAX reads the SLURM environment (co2jax.distributed.initialize() with no arguments).
#SBATCH --job-name=co2jax
#SBATCH --exclusive
set -euo pipefail
PRESET=${1:-pod-150m}; DATA=${2:?give the .bin token file}; shift 2 || true
echo "co2jax: preset ${PRESET} on ${SLURM_JOB_NUM_NODES:-?} nodes, data ${DATA}, overrides: $*"
srun python -m experiments.train --preset "${PRESET}" --distributed data.path="${DATA}" "$@"
