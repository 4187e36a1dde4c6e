#!/usr/bin/env bash
# The checks that need a CUDA device, in few long runs: run on a GPU machine from the repository
# root, with a Python that has this project's dependencies (`pip install -e ".[test]"`, no -c).
#
#     scripts/gpu_checks.sh OUT_DIR [PART ...]     PART: tests megatron sampler offload kernels weights medusa
#                                                  jobs pipeline speed medusa358 agentic sharing profile trainstep
#                                                  (default: all but the last six)
#
#   tests     pytest -m gpu, Triton compiled for the device (TRITON_INTERPRET=0): kernels vs
#             references, CUDA IPC weight sync, engine offload round trip, whole jobs on cuda:0
#             (not the files of the two parts below)
#   megatron  tests/test_megatron_cuda.py: the megatron engine on cuda:0 vs the torch engine
#             (forward, training with the distributed optimizer, offload, bf16), every number in the log;
#             then text_ppo on cuda with both trainers on megatron (tp 1, bf16 by precision auto): its summary;
#             then 10 iterations of it with the forwards and the trainers on megatron in two device groups
#   sampler   tests/test_sampler_cuda.py: decode attention and KV cache on cuda:0 vs the CPU and eager;
#             tests/test_static_decode_cuda.py: decode steps as CUDA graphs vs static and eager, captures;
#             then bench/decode.py --device cuda: eager, static and graphs tokens/s (plain and Medusa)
#   offload   offload policies and device groups on cuda:0: DeviceTurns and the torch engine's round
#             trip (tests), then bench/offload.py --device cuda on the main job (6 iterations a
#             column): every stage its own process, the forwards and the trainers in two device
#             groups offloading after each step (sync), and the same pipelined with each onload
#             prefetched: iteration time, host PSS, CUDA peaks, MB moved, onload time hidden
#   kernels   bench/kernels.py: fused log-probs vs eager, bf16, time and peak memory
#   weights   bench/weight_sync.py: shm, gloo and CUDA IPC vs reloading a file
#   medusa    bench/medusa.py --device cuda: speculative decoding columns timed on the GPU
#   jobs      stream-rlhf run text_grpo and mllm_ppo (the main job) with every torch stage on cuda
#   pipeline  bench/pipeline.py: stream vs sync schedules, stages on cuda
#   speed     issue 32's GPU checks in at most 8 minutes (warm starts carried; each command has its own
#             time limit, and a command cut off leaves its log): the GPU tests of the warm start on the
#             device, the checkpoint snapshot's reserved pinned memory, the weights publish's pinned snapshot,
#             the decode graphs' bucket ladder, `stream-rlhf episodes` on the device and the allocator's trace
#             counter, bench/vs_trl.py --device cuda (the 90M
#             fp32 and 358M bf16 rows, 64 fixed answer tokens, their warm starts trained on the GPU, TRL
#             with use_cpu=False: carry TRL's wheels in .whl/ or set TRL_PYTHON), and the main job with
#             every stage on cuda:0 and an empty Triton cache: its first and median iteration, and the
#             slowest after the second against the median, and the trainers' phases (seconds per iteration)
#             and CUDA allocator growth from its trace
#   medusa358 issue 32's Medusa target, 200 s at most: bench/medusa.py --device cuda --model 358M
#   agentic   issue 34 on the GPU, 150 + 300 s at most: bench/agentic_rollout.py --device cuda (the episode
#             engine alone: lock-step against 1, 2 and 4 mini-batches of tool-using episodes in flight, the
#             tool sleeping 50 ms), then bench/agentic.py --device cuda (the issue's benchmark: the tool job's
#             three columns with every torch stage on cuda:0); the tool job's warm start: carry runs/.cache
#   sharing   issue 32 item 5, 420 s at most: bench/gpu_sharing.py (SHARING_ITERATIONS, default 6, of the
#             main job on cuda:0 as separate
#             processes, in two device groups, and under a CUDA MPS server started for it: iteration time and
#             nvidia-smi device memory, contexts included; the fastest and the leanest named)
#   profile   issue 32's main-job median, 150 s at most: the main job on cuda:0 with py-spy (native frames) on
#             actor_train and critic_train for 20 s each (OUT_DIR/<stage>.raw; carry py-spy's wheel in .whl/),
#             then its iteration times and the trainers' phases from its trace (seconds per iteration)
#   trainstep issue 32's host-bound trainers, 210 s at most: tests/test_train_step_device.py's gpu tests (one
#             synchronisation of ours per step, text and vision-language), then bench/train_step.py --device cuda
#             (an actor and a critic step of the main job's model, 128 samples: the loss's inputs gathered at once
#             against the per-sample path; ms, aten ops and autograd nodes per step), then bench/step_memory.py
#             --device cuda (a 12M actor step in micro-batches and with activation checkpointing: CUDA peak MB)
#
# Each part writes OUT_DIR/<part>.log (and its --json figures as the log's last line); one failing
# part does not stop the others; the exit status is the number of parts that failed.
# The jobs warm-start their tiny models first (a few hundred SFT steps, minutes on a GPU: launch-bound);
# carry the warm starts made here (runs/.cache: the tiny-* folders and the shapes-* dataset, found by
# content wherever the checkout is) to skip that.
# Wheels in .whl/ (packages the machine lacks, e.g. megatron-core, pyzmq, msgspec: pip download
# them for its Python) are installed first into /tmp/site, which goes on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_checks.sh OUT_DIR [PART ...]}
shift
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests megatron sampler offload kernels weights medusa jobs pipeline)
mkdir -p "$out"
python=${PYTHON:-python3}
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
own_parts=(--ignore=tests/test_megatron_cuda.py --ignore=tests/test_sampler_cuda.py  # run by their parts
           --ignore=tests/test_static_decode_cuda.py
           --ignore=tests/test_device_turns.py)
offload_jobs() {
    "$python" -m pytest -q -m gpu -p no:cacheprovider -rA tests/test_device_turns.py tests/test_torch_engine.py &&
    "$python" bench/offload.py --device cuda --iterations 6 --columns separate full_offload pipelined --json
}

megatron_groups() {  # every model stage on megatron, the forwards and the trainers in two device groups
    local on_megatron='{backend: megatron}'
    "$python" -m stream_rlhf.cli run configs/text_ppo.yaml --set placement.device=cuda --set name=gpu_megatron_groups \
        --set iterations=10 --set 'placement.with_rollout=[]' \
        --set 'placement.device_groups={forwards: [ref_forward, critic_forward], trainers: [actor_train, critic_train]}' \
        --set "placement.stages={ref_forward: $on_megatron, critic_forward: $on_megatron, actor_train: $on_megatron,
               critic_train: $on_megatron}" &&
    cat runs/gpu_megatron_groups/summary.json
}

iteration_times() {  # the trainer's iteration_s of run $1: first, median, slowest after the second / median
    "$python" -c 'import json, statistics, sys
times = [json.loads(line)["iteration_s"] for line in open(sys.argv[1])]
median = statistics.median(times)
print(json.dumps({"iterations": len(times), "first_s": times[0], "median_s": median,
                  "worst_after_second_over_median": round(max(times[2:], default=0) / median, 3), "all_s": times}))' \
        "runs/$1/metrics.jsonl"
}

trainer_phases() {  # the trainers' spans of run $1 (cat "train"): mean seconds per iteration and per call;
    # the CUDA allocator's segments (cudaMalloc calls so far) at the first, middle and last step of each process
    "$python" -c 'import json, collections, sys
events = json.load(open(sys.argv[1]))
events = events["traceEvents"] if isinstance(events, dict) else events
names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
total, calls = collections.Counter(), collections.Counter()
for e in events:
    if e.get("ph") == "X" and (e.get("cat") == "train" or e["name"].endswith(" experience") or e["name"].startswith("weights")):
        key = names.get(e["pid"], str(e["pid"])) + " " + e["name"]
        total[key] += e["dur"] / 1e6
        calls[key] += 1
allocator = collections.defaultdict(list)  # the caching allocator after each step: growth in steady state stalls
for e in events:
    if e.get("ph") == "C" and e["name"] == "cuda allocator":
        allocator[names.get(e["pid"], str(e["pid"]))].append(e["args"])
iterations = sum(1 for _ in open(sys.argv[2]))
print(json.dumps({"iterations": iterations, "s_per_iteration": {k: round(v / iterations, 4) for k, v in total.most_common()},
                  "s_per_call": {k: round(total[k] / calls[k], 4) for k in total},
                  "cuda_allocator": {k: {"samples": len(v), "segments": [v[0]["segments"], v[len(v) // 2]["segments"],
                                                                         v[-1]["segments"]],
                                         "reserved_mb_last": v[-1]["reserved_mb"], "retries": v[-1]["retries"]}
                                     for k, v in allocator.items()}}))' "runs/$1/trace.json" "runs/$1/metrics.jsonl"
}

profile_trainers() {  # issue 32: where the GPU trainers' host time goes, 150 s at most: py-spy (carry its
    # wheel in .whl/) on actor_train and critic_train for 20 s each, native frames included (CUDA waits)
    local spy=/tmp/site/bin/py-spy name=gpu_profile_main
    [ -x "$spy" ] || spy=$(command -v py-spy) || { echo "no py-spy: carry its wheel in .whl/" >&2; return 1; }
    TRITON_CACHE_DIR=$(mktemp -d) timeout 120 "$python" -m stream_rlhf.cli run configs/mllm_ppo.yaml \
        --set placement.device=cuda --set name=$name --set iterations=30 > "$out/profile_job.log" 2>&1 &
    local job=$! waited=0
    until [ "$(wc -l < "runs/$name/metrics.jsonl" 2>/dev/null || echo 0)" -ge 3 ]; do
        sleep 1; waited=$((waited + 1))
        [ $waited -lt 90 ] && kill -0 $job 2>/dev/null || { echo "the job gave no 3 iterations" >&2; wait $job; return 1; }
    done
    for stage in actor_train critic_train; do
        local pid
        pid=$(grep -o "$stage joined (pid [0-9]*" "$out/profile_job.log" | grep -o "[0-9]*$")
        timeout 40 "$spy" record -p "$pid" -d 20 -r 100 --native --nonblocking -f raw -o "$out/$stage.raw" &
    done
    wait $job
    local code=$?
    wait
    iteration_times $name && trainer_phases $name
    return $code
}

stop_leftovers() {  # a command cut off by its timeout leaves its job's processes running: stop them first
    pkill -TERM -f 'stream_rlhf|trl_grpo' && sleep 10
    pkill -KILL -f 'stream_rlhf|trl_grpo|multiprocessing\.(spawn|forkserver)'
    return 0
}

speed_checks() {  # issue 32: 90 + 300 + 90 s at most (the 358M TRL side was cut at 270)
    local failed=0
    timeout 90 "$python" -m pytest -q -m gpu -p no:cacheprovider -rA tests/test_warm_start_device.py \
        tests/test_background_checkpoints.py tests/test_torch_engine.py tests/test_static_decode_cuda.py \
        tests/test_try_episodes.py tests/test_background_publish.py tests/test_cuda_allocator.py \
        -k "warm_start or snapshot or first_batch or cuda_job or cuda_engine or gpu_step" || failed=1
    timeout 300 "$python" bench/vs_trl.py --device cuda --trl-python "${TRL_PYTHON:-$python}" --json ||
        { failed=1; stop_leftovers; }
    TRITON_CACHE_DIR=$(mktemp -d) timeout 90 "$python" -m stream_rlhf.cli run configs/mllm_ppo.yaml \
        --set placement.device=cuda --set name=gpu_speed_main --set iterations=12 || { failed=1; stop_leftovers; }
    iteration_times gpu_speed_main || failed=1
    trainer_phases gpu_speed_main || failed=1
    return $failed
}

if compgen -G ".whl/*.whl" > /dev/null; then
    if "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl; then
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
        echo "carried wheels: $(cd .whl && echo *.whl)" | tee "$out/wheels.txt"
    else
        echo "carried wheels did not install (another Python?): going on without them" | tee "$out/wheels.txt" >&2
    fi
fi

run_part() {
    case "$1" in
        tests) "$python" -m pytest -q -m gpu -p no:cacheprovider -rs tests "${own_parts[@]}" ;;
        megatron) "$python" -m pytest -q -m gpu -p no:cacheprovider -rA tests/test_megatron_cuda.py &&
                  "$python" -m stream_rlhf.cli run configs/text_ppo.yaml --set placement.device=cuda --set name=gpu_megatron \
                      --set "placement.stages={actor_train: {backend: megatron}, critic_train: {backend: megatron}}" &&
                  cat runs/gpu_megatron/summary.json && megatron_groups ;;
        sampler) "$python" -m pytest -q -m gpu -p no:cacheprovider -rA tests/test_sampler_cuda.py \
                     tests/test_static_decode_cuda.py && "$python" bench/decode.py --device cuda --json ;;
        offload) offload_jobs ;;
        kernels) "$python" bench/kernels.py --json ;;
        weights) "$python" bench/weight_sync.py --json ;;
        medusa) "$python" bench/medusa.py --device cuda --json ;;
        jobs) "$python" -m stream_rlhf.cli run configs/text_grpo.yaml --set placement.device=cuda &&
              "$python" -m stream_rlhf.cli run configs/mllm_ppo.yaml --set placement.device=cuda ;;
        pipeline) "$python" bench/pipeline.py --json ;;
        speed) speed_checks ;;
        medusa358) timeout 200 "$python" bench/medusa.py --device cuda --model 358M --iterations 10 --json ;;
        agentic) timeout 150 "$python" bench/agentic_rollout.py --device cuda --json;
                 local engine=$?
                 timeout 300 "$python" bench/agentic.py --device cuda --json && [ $engine -eq 0 ] ;;
        sharing) timeout 420 "$python" bench/gpu_sharing.py --iterations "${SHARING_ITERATIONS:-6}" --json ;;
        profile) profile_trainers ;;
        trainstep) timeout 60 "$python" -m pytest -q -m gpu -p no:cacheprovider -rA tests/test_train_step_device.py &&
                   timeout 90 "$python" bench/train_step.py --device cuda --json &&
                   timeout 60 "$python" bench/step_memory.py --device cuda --json ;;
        *) echo "unknown part $1: tests megatron sampler offload kernels weights medusa jobs pipeline speed medusa358 agentic sharing profile trainstep" >&2
           return 2 ;;
    esac
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
"$python" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
    | tee -a "$out/device.txt"
"$python" -c "from importlib.metadata import version as v; print(*(f'{n} {v(n)}' for n in ('transformers', 'megatron-core')))" \
    2>&1 | tail -n 1 | tee -a "$out/device.txt"
failed=0
for part in "${parts[@]}"; do
    start=$SECONDS
    run_part "$part" > "$out/$part.log" 2>&1
    rc=$?
    echo "$part: exit $rc in $((SECONDS - start)) s" | tee -a "$out/device.txt"
    [ $rc -eq 0 ] || failed=$((failed + 1))
done
exit $failed
