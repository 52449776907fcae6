#!/usr/bin/env bash
# Launch a co2jax pretraining run on a multi-slice TPU job: one replica per slice (the replica
# axis spans the slices, so only the outer step's reduction crosses the data-center network).
# Usage: QR=my-queued-resource ZONE=us-west4-a PRESET=pod-1b DATA=/data/tokens.bin \
#        bash experiments/scripts/tpu_multislice.sh [overrides...]
# The slices come from one queued resource (gcloud compute tpus queued-resources create QR
# --node-count=N ...); the TPU runtime sets the multi-slice environment on every host, and
# co2jax.distributed.initialize() (--distributed) finds all hosts of all slices.
# Check first that the round fits: python -m experiments.aot --preset pod-1b --slices N ...
set -euo pipefail
: "${QR:?set QR (the queued resource)}" "${ZONE:?set ZONE}" "${DATA:?set DATA (a .bin token file on every host)}"
PRESET=${PRESET:-pod-1b}
REPO=${REPO:-~/co2jax}
echo "co2jax: preset ${PRESET} on the slices of ${QR} (${ZONE}), data ${DATA}, overrides: $*"
gcloud compute tpus queued-resources ssh "${QR}" --zone "${ZONE}" --node=all --worker=all \
  --command "cd ${REPO} && python -m experiments.train --preset ${PRESET} --distributed data.path=${DATA} $*"
