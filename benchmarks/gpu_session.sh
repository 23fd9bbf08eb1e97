#!/usr/bin/env bash
# The GPU checks still open for the learner (issue 20), in stages that each fit one device call (< 10 min).
# Logs and result JSON go to $OUT (default: gpu-out/), so they come back even from a call that times out.
#
#   source .gpu/env.sh; bash benchmarks/gpu_session.sh learner3b     # on the lent GPU box (see docs/gpu.md)
#   bash benchmarks/gpu_session.sh smoke                              # anywhere: the tiny model, seconds
#
# Stages:
#   smoke      the tiny model, torch backend, rows and shared prompt (checks the script itself)
#   learner3b  Qwen2.5-VL-3B sizes, beta 0.04, torch backend: MFU per lever of issue 52 (4 min 11 s on an H100,
#              2026-11-27), one at a time from the learner as it was: full_unshared (the frozen vision tower run by
#              the reference and the policy), full (once per micro-batch), full_master (and bf16 parameters + fp32
#              master weights), full_shared_master (and each prompt once), full_master_compiled (full_master and
#              learner.compile: each decoder layer compiled by inductor; its warm-up step compiles),
#              full_master_sdpa_per_chunk (full_master with transformers' vision attention call per window, not
#              packed); a profiled step each (aten ops, kernels) under $OUT/profile_3b_levers. On a CPU, the
#              script's own check (the tiny model, bf16 asked for):
#              SIZE=tiny LEVER_ARGS="--set learner.bf16=true" bash benchmarks/gpu_session.sh learner3b
#   matrix3b   Qwen2.5-VL-3B sizes, beta 0.04: torch and DeepSpeed ZeRO-2 x full, full_shared, lora:
#              step time, tokens/s, MFU (goal >= 35%), CUDA peak against the static memory plan, and one
#              profiled step each (top kernels by GPU time, kernel count) under $OUT/profile_3b; then
#              full_shared without gradient checkpointing (an oom row is an answer too)
#   recompute3b  Qwen2.5-VL-3B sizes, torch full, beta 0.04: recomputing every layer (the baseline), every 2nd,
#              every 3rd, none, and every layer with its saved inputs on the host (learner.checkpoint_every /
#              checkpoint_offload): step time against CUDA peak, to pick the least recomputation that fits
#   learner7b  Qwen2.5-VL-7B sizes, beta 0.04: LoRA r=64 on one GPU (goal: fits 80 GB, MFU >= 35%): eager with the
#              default dropout (lora) and none (lora_nodropout), and with learner.compile (lora_compiled, dropout 0:
#              compile refuses LoRA dropout), full weights with the torch backend (the plan must refuse it before
#              loading: wont_fit)
#   rollout3b  the HF engine (log-probs in the sampling loop) against plain model.generate at 3B, G=8, 128
#              new tokens, 16 frames 448x448 (goal: >= 0.95x plain generate's speed; 0.80x before)
#   deepspeed3b  Qwen2.5-VL-3B sizes, beta 0.04: learner.compile under DeepSpeed ZeRO-2 (one rank, its bf16 mode):
#              deepspeed full against deepspeed full_compiled (inductor; its warm-up step compiles), with the torch
#              backend's full and full_compiled in the same run (the figures' baseline: torch full). On a CPU:
#              SIZE=tiny LEVER_ARGS="--set learner.compile_backend=aot_eager" bash benchmarks/gpu_session.sh deepspeed3b
#   longvideo  Qwen2.5-VL-3B sizes, torch backend, each prompt once (full_shared), G=8, 128-token completions:
#              one step at 32, 64, 128, 256, 512 frames per video at Video-R1's per-frame budget (308 x 308 ~ 121
#              patches of 28 x 28 after the 2x2 merge: 128 x 28 x 28 pixels), CUDA peak against the memory plan
#              (`config memory`'s, the frontier table of docs/performance.md), until a length runs out of memory;
#              FRAMES / FRAME_SIZE / MODES to change it. On a CPU: SIZE=tiny FRAMES="4 8" bash ... longvideo
#   offload7b  7B full weights with ZeRO-2 optimizer offload (the plan: ~31 GiB on the GPU, ~114 GiB host)
#   tests      the unit suite on the GPU (CUDA variants included) and the GPU integration tests
#   agreement  generator = learner at the 3B shape in bf16 on CUDA (goal: KL <= 0.01 at staleness 0):
#              `streamgrpo check agreement` with the HF engine, plain and with model.fp32_lm_head, then an
#              8-step `up` of qwen2_5_vl_3b_1node on one GPU with the torch and the DeepSpeed backend
#              (kl_fresh, kl_behaviour, is_masked_frac, ess of each step into $OUT/agreement_up_*.jsonl)
set -uo pipefail
stage=${1:-}
OUT=${OUT:-gpu-out}
py=${PYTHON:-python}
mkdir -p "$OUT"
learner() {  # learner NAME ARGS...: one gpu_learner run, its log and JSON under $OUT
  local name=$1; shift
  "$py" -m benchmarks.gpu_learner "$@" --out "$OUT/gpu_learner_$name.json" 2>&1 | tee "$OUT/$name.log"
}
case "$stage" in
  smoke) learner smoke --size tiny --steps 1 --warmup 0 --backends torch --modes full,full_shared \
           --profile "$OUT/profile_smoke" ;;
  learner3b)
    learner 3b_levers --size "${SIZE:-3b}" --beta 0.04 --steps 3 --warmup 1 --backends torch \
      --modes "${MODES:-full_unshared,full,full_master,full_shared_master,full_master_compiled,full_master_sdpa_per_chunk}" \
      --profile "$OUT/profile_3b_levers" \
      ${LEVER_ARGS:-} ;;
  matrix3b)
    learner 3b --size 3b --beta 0.04 --steps 3 --backends torch,deepspeed --modes full,full_shared,lora \
      --profile "$OUT/profile_3b"
    # with each prompt once the activations are ~4.5x smaller: does the step fit without recomputation?
    learner 3b_norecompute --size 3b --beta 0.04 --steps 3 --backends torch --modes full_shared \
      --no-gradient-checkpointing ;;
  recompute3b)
    for every in 1 2 3; do
      learner "3b_every$every" --size 3b --beta 0.04 --steps 3 --backends torch --modes full --checkpoint-every "$every"
    done
    learner 3b_offload --size 3b --beta 0.04 --steps 3 --backends torch --modes full --checkpoint-offload
    learner 3b_none --size 3b --beta 0.04 --steps 3 --backends torch --modes full --no-gradient-checkpointing ;;
  learner7b) learner 7b --size 7b --beta 0.04 --steps 2 --backends torch --modes "${MODES:-lora,lora_nodropout,lora_compiled,full}" \
      --lora-r 64 ;;
  rollout3b)
    "$py" -m benchmarks.bench_engine --model-size 3b --prompts 1 --n 8 --max-tokens 128 --frames 16 --size 448 \
      --repeats 3 --out "$OUT/bench_engine_3b.json" 2>&1 | tee "$OUT/rollout3b.log" ;;
  deepspeed3b)
    learner 3b_deepspeed --size "${SIZE:-3b}" --beta 0.04 --steps 3 --warmup 1 --backends torch,deepspeed \
      --modes "${MODES:-full,full_compiled}" ${LEVER_ARGS:-} ;;
  longvideo)
    for frames in ${FRAMES:-32 64 128 256 512}; do
      learner "longvideo_${SIZE:-3b}_$frames" --size "${SIZE:-3b}" --beta 0.04 --steps 1 --warmup 0 --backends torch \
        --modes "${MODES:-full_shared}" --frames "$frames" --frame-size "${FRAME_SIZE:-308}" --G 8 --completion-len 128
      grep -qE '"(oom|wont_fit)"' "$OUT/gpu_learner_longvideo_${SIZE:-3b}_$frames.json" 2>/dev/null && break  # longer ones won't fit
    done
    "$py" -c "import json, sys
for p in sys.argv[1:]:
    for r in json.load(open(p)).get('rows', []):
        print(p.rsplit('_', 1)[-1][:-5], 'frames:', r.get('mode'), r.get('status', 'ok'), 'peak', r.get('peak_gib'),
              'GiB, plan', r.get('plan_gib'), 'GiB')" "$OUT"/gpu_learner_longvideo_*.json | sort -n | tee "$OUT/longvideo.txt" ;;
  offload7b) learner 7b_offload --size 7b --beta 0.04 --steps 2 --backends deepspeed_offload --modes full ;;
  tests)
    "$py" -m pytest -q -p no:cacheprovider -n 8 tests/unit 2>&1 | tail -40 | tee "$OUT/unit.log"
    "$py" -m pytest -q -p no:cacheprovider tests/integration/repo/test_gpu_learner_bench.py \
      tests/integration/learner/test_dist_backend.py tests/integration/learner/test_zero_offload.py \
      tests/integration/learner/test_learner_core.py 2>&1 | tail -40 | tee "$OUT/integration.log" ;;
  agreement)
    work=${WORK:-/tmp/sg-agreement}
    mkdir -p "$work"
    # MODEL_ARGS / GPUS: the script's own check on a CPU (MODEL_ARGS="--size tiny" GPUS=cpu)
    [ -f "$work/m3b/config.json" ] || "$py" -m streamgrpo model tiny ${MODEL_ARGS:---size 3b} --out "$work/m3b" 2>&1 | tail -1
    [ -f "$work/data/train.jsonl" ] || "$py" -m streamgrpo data demo --out "$work/data" --n 200 >/dev/null
    common=(--config qwen2_5_vl_3b_1node --set "model.name_or_path=$work/m3b" --set "data.train_path=$work/data/train.jsonl"
            --set data.media_root=null --set rollout.engine=hf --set loss.beta=0 --set rollout.max_completion_length=64
            --set learner.groups_per_step=4 --set eval.enabled=false)
    for head in false true; do
      "$py" -m streamgrpo check agreement "${common[@]}" --set "model.fp32_lm_head=$head" --groups 2 --max-tokens 64 \
        --out "$OUT/agreement_check_fp32head_$head.json" 2>&1 | grep -v "Loading weights" | tail -12 \
        | tee "$OUT/agreement_check_fp32head_$head.log"
    done
    for backend in torch deepspeed; do
      timeout 240 "$py" -m streamgrpo up "${common[@]}" --gpus "${GPUS:-0}" --learner-ranks 1 --generators 1 --colocate \
        --set "learner.backend=$backend" --set learner.max_steps=8 --set learner.save_steps=1000 \
        --run-dir "$work/up_$backend" 2>&1 | tail -15 | tee "$OUT/agreement_up_$backend.log"
      "$py" -c "import json, sys; [print(json.dumps({k: r.get(k) for k in ('step', 'kl_fresh', 'fresh_tokens', \
'kl_behaviour', 'is_masked_frac', 'ess', 'ratio_min', 'ratio_max')})) for r in map(json.loads, open(sys.argv[1]))]" \
        "$work/up_$backend/metrics.jsonl" | tee "$OUT/agreement_up_$backend.jsonl"
    done ;;
  *) echo "usage: bash benchmarks/gpu_session.sh smoke|learner3b|matrix3b|recompute3b|learner7b|deepspeed3b|rollout3b|longvideo|offload7b|tests|agreement" >&2; exit 2 ;;
esac
