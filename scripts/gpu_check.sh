#!/bin/bash
# The GPU check: what of the CUDA + NCCL path a maintainer with one GPU (or more) can prove in a
# few minutes, one summary line per check. Run from anywhere, with the project installed:
#
#   scripts/gpu_check.sh            # every check; a log per check in $GPU_CHECK_LOGS (default: a temp dir)
#   GPU_CHECK_DEVICE=cpu scripts/gpu_check.sh   # the same commands on CPU + gloo: a dry run of the script
#
# Each line reads "PASS|FAIL|SKIP <check> (<seconds> s)[: why]"; the exit status is 1 if any
# check failed. Checks that need more GPUs than the machine has say SKIP with how many they need.
# docs/ci.md lists what of the GPU path is proven on CPU by simulation only.
set -uo pipefail
cd "$(dirname "$0")/.."
logs="${GPU_CHECK_LOGS:-$(mktemp -d -t gpu-check-XXXXXX)}"
mkdir -p "$logs"
device="${GPU_CHECK_DEVICE:-cuda}"
gpus=$(python -c "from harness.config.gpu_count import visible_gpu_count; print(visible_gpu_count())")
if [[ $device == cpu ]]; then gpus=64; fi  # the dry run: every check runs, on CPU
failed=0
echo "gpu check on $device: $gpus visible GPU(s); logs in $logs"

# check NAME GPUS_NEEDED COMMAND...: run COMMAND, one summary line from its exit status.
check() {
    local name=$1 needed=$2
    shift 2
    if ((gpus < needed)); then
        echo "SKIP $name: needs $needed GPUs, $gpus visible"
        return
    fi
    local started=$SECONDS
    if "$@" >"$logs/$name.log" 2>&1; then
        echo "PASS $name ($((SECONDS - started)) s)"
    else
        echo "FAIL $name ($((SECONDS - started)) s): see $logs/$name.log"
        failed=1
    fi
}

# pytest with the suite's plugins, quiet, no cache; OMP_NUM_THREADS=1 so pytest forks its zygote.
run_pytest() { OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider "$@"; }

# 1. Fork-safe discovery: pytest counts GPUs without the CUDA runtime, no rank is in torch's bad
#    fork (forked zygote and cold one), under --device auto, cpu and cuda.
check fork-discovery 1 run_pytest tests/harness_tests/test_zygote_start.py
# 2. One rank on CUDA with NCCL, forked and cold, every traced collective of a world of one.
check nccl-trace-world-of-one 1 run_pytest tests/harness_tests/test_trace.py tests/harness_tests/test_trace_below_python.py \
    --device $device --world-sizes 1
# 3. A rank stuck in an NCCL collective no peer joins: stopped by the one-sided watch.
check nccl-one-sided-wait 2 run_pytest tests/harness_tests/test_divergence_one_sided.py --device $device
# 4. Per-test device state on a warm CUDA rank (default device, TF32, streams, sticky errors).
check cuda-isolation 1 run_pytest tests/harness_tests/test_isolation.py --device $device --world-sizes 1
# 5. The unshard scenarios on CUDA at world size 1, and the generated CI set (programs of 2 ranks
#    or more: it needs 2 GPUs), against the backends that run there.
check conformance-cuda-unshard 1 run_pytest conformance/test_unshard_params.py --device $device --world-sizes 1 \
    --backend reference --backend torch-fsdp1 --backend torch-fsdp2
# 6. An NCCL watchdog timeout: the rank's cause and the Flight Recorder dumps in the report (the
#    simulated one on any machine; the real one needs 2 GPUs and is skipped below that).
check nccl-watchdog-report 1 run_pytest tests/harness_tests/test_watchdog_report.py
check conformance-cuda-generated 2 run_pytest conformance/test_generated.py --device $device \
    --backend reference --backend torch-fsdp1 --backend torch-fsdp2

exit $failed
