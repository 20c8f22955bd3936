#!/bin/bash
# Run the conformance suite on a multi-node SLURM allocation with torchrun: one torchrun agent per
# node, every GPU of every node a rank, all nodes running the same pytest selection in lockstep.
#
#   sbatch --nodes=2 --gpus-per-node=8 scripts/slurm_torchrun.sh                  # all of conformance/
#   sbatch --nodes=2 --gpus-per-node=8 scripts/slurm_torchrun.sh --backend torch-fsdp2 -k training
#
# Arguments are passed to pytest (default: --backend reference). Environment knobs:
#   NPROC_PER_NODE   ranks per node (default: SLURM_GPUS_ON_NODE, else the GPUs nvidia-smi lists)
#   RDZV_PORT        the c10d rendezvous port on the first node (default 29500)
#   DEVICE           cuda (default) or cpu; with cpu set NPROC_PER_NODE
#   REPORTS_DIR      where rank-<r>.xml and conformance.md go, on a file system every node sees
#                    (default: reports/slurm-$SLURM_JOB_ID in the submission directory)
#   PYTHON           the interpreter with the suite installed (default: python)
# Set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the interface the nodes reach each other on if
# the default choice is wrong (for example a management network that does not route between them).
#
#SBATCH --job-name=fsdp-conformance
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --time=02:00:00
#SBATCH --output=slurm-fsdp-conformance-%j.out

set -euo pipefail

if [[ -z "${SLURM_JOB_ID:-}" ]]; then
    echo "run this script with sbatch (or inside an salloc allocation with srun available)" >&2
    exit 2
fi

cd "${SLURM_SUBMIT_DIR:-$PWD}"
PYTHON=${PYTHON:-python}
DEVICE=${DEVICE:-cuda}
RDZV_PORT=${RDZV_PORT:-29500}
REPORTS_DIR=${REPORTS_DIR:-reports/slurm-$SLURM_JOB_ID}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    if [[ "$DEVICE" != cuda ]]; then
        echo "DEVICE=$DEVICE: set NPROC_PER_NODE to the number of ranks per node" >&2
        exit 2
    elif [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
        NPROC_PER_NODE=$SLURM_GPUS_ON_NODE
    else
        NPROC_PER_NODE=$(nvidia-smi --list-gpus | wc -l)
    fi
fi
if (( $# == 0 )); then
    set -- --backend reference
fi
mkdir -p "$REPORTS_DIR"

echo "fsdp-conformance: $SLURM_NNODES nodes x $NPROC_PER_NODE ranks, rendezvous $HEAD_NODE:$RDZV_PORT, reports in $REPORTS_DIR"

# One task per node; each starts a torchrun agent that starts NPROC_PER_NODE ranks. The agents
# meet at the first node (c10d rendezvous keyed by the job id). --max-restarts=0: a rank that dies
# ends the job (torchrun mode cannot restart one rank in the middle of a lockstep session); the
# per-rank JUnit files written so far say which test it was.
set +e
srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
    "$PYTHON" -m torch.distributed.run \
        --nnodes="$SLURM_NNODES" \
        --nproc-per-node="$NPROC_PER_NODE" \
        --rdzv-backend=c10d \
        --rdzv-endpoint="$HEAD_NODE:$RDZV_PORT" \
        --rdzv-id="fsdp-conformance-$SLURM_JOB_ID" \
        --max-restarts=0 \
        -m pytest conformance \
            --device "$DEVICE" \
            --reports-dir "$REPORTS_DIR" \
            -p no:cacheprovider \
            "$@"
status=$?
set -e

shopt -s nullglob
junit_files=("$REPORTS_DIR"/junit/rank-*.xml)
echo "fsdp-conformance: exit status $status, ${#junit_files[@]} per-rank JUnit files in $REPORTS_DIR/junit"
exit $status
