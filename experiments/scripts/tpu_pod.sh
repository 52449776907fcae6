#!/usr/bin/env bash
# Launch a co2jax pretraining run on a multi-host TPU pod slice (every host runs the same line).
# Usage: TPU_NAME=my-pod ZONE=us-central2-b PRESET=pod-150m DATA=/data/tokens.bin \
#        bash experiments/scripts/tpu_pod.sh [overrides...]
# JAX finds the pod's hosts itself (co2jax.distributed.initialize() with no arguments).
set -euo pipefail
: "${TPU_NAME:?set TPU_NAME}" "${ZONE:?set ZONE}" "${DATA:?set DATA (a .bin token file on every host)}"
PRESET=${PRESET:-pod-150m}
REPO=${REPO:-~/co2jax}
echo "co2jax: preset ${PRESET} on TPU pod ${TPU_NAME} (${ZONE}), data ${DATA}, overrides: $*"
gcloud compute tpus tpu-vm ssh "${TPU_NAME}" --zone "${ZONE}" --worker=all --command \
  "cd ${REPO} && python -m experiments.train --preset ${PRESET} --distributed data.path=${DATA} $*"
