#!/usr/bin/env bash
# One device call: install, then the STEPS asked for, each logged to $OUT/<step>.log. Run from the
# repository root; everything lands in $OUT.
#   STEPS="gpu_smoke hf_sdpa lengths attention lce ce dan act train gap recompute memory memory_llama long
#          curve tune llama cuda_graphs fp8_curve fp8_speed window bloom alibi memory_llama_fractions
#          window_model plan_estimate fp8_rowwise budget_windows bloom_rewrites grouped gather first_step
#          fleet fleet_bf16 peak_snapshot fp32_split"   (default: DEFAULT_STEPS)
# Each step's timeout and arguments can be set by the variables it reads (TRAIN_TIMEOUT, MEMORY_ARGS, ...).
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-benchmarks/results}
export OPSMATH_CACHE_DIR=${OPSMATH_CACHE_DIR:-$OUT/opsmath-cache}
DEFAULT_STEPS="gpu_smoke attention lce ce dan act train gap recompute memory memory_llama long curve tune llama"
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
# Liger-Kernel for the memory-bound comparisons, where its wheel was brought along in benchmarks/wheels
# (git-ignored: pip download liger-kernel --no-deps -d benchmarks/wheels), installed without dependencies
ls benchmarks/wheels/liger_kernel-*.whl >/dev/null 2>&1 && \
    python3 -m pip install -q --no-deps benchmarks/wheels/liger_kernel-*.whl >> "$OUT/install.log" 2>&1
step() {  # step NAME TIMEOUT CMD...
    local name=$1 limit=$2; shift 2
    case " ${STEPS:-$DEFAULT_STEPS} " in *" $name "*) ;; *) return ;; esac
    echo "== $name"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "rc=$? ($name)"; grep -v -i "warn" "$OUT/$name.log" | tail -${TAIL:-30}
}
B="python3 -m benchmarks"
# the smoke subset on GPU_SMOKE_WORKERS pytest workers sharing the GPU (serially it outran a 320 s call limit)
step gpu_smoke ${GPU_SMOKE_TIMEOUT:-560} env OPSMATH_TEST_DEVICE=cuda python -m pytest -q -rfE --durations=12 \
    -n ${GPU_SMOKE_WORKERS:-4} -m gpu_smoke tests
step hf_sdpa ${HF_SDPA_TIMEOUT:-540} $B hf_default_attention ${HF_SDPA_ARGS:-}
step lengths ${LENGTHS_TIMEOUT:-540} $B varying_lengths ${LENGTHS_ARGS:-}
step attention ${ATTN_TIMEOUT:-420} $B attention ${BENCH_ARGS:-}
step lce 120 $B linear_cross_entropy
step ce 150 $B cross_entropy
step dan 150 $B dropout_add_norm --compile
step act 200 $B activations
step train ${TRAIN_TIMEOUT:-400} $B train --gpt --only "${TRAIN_ONLY:-}"
step gap 240 $B profile_gap --pair "${GAP_PAIR:-torch.compile + SDPA,opsmath.optimize}"
step recompute 200 $B profile_gap --pair "opsmath op-by-op,opsmath budget 0.5" --tag recompute
step memory ${MEMORY_TIMEOUT:-400} $B memory ${MEMORY_ARGS:---quick --paths inductor --no-long}
step memory_llama ${MEMORY_LLAMA_TIMEOUT:-560} $B memory --model llama ${MEMORY_LLAMA_ARGS:---quick --paths inductor --no-long}
step long ${LONG_TIMEOUT:-400} $B memory --long-only ${LONG_ARGS:---variants "opsmath 8GiB SDPA-model" --lengths 65536}
step curve 300 $B learning_curve
step tune 200 python3 -m opsmath.ui.cli tune --example gpt
step llama 500 $B train --llama --only "${LLAMA_ONLY:-eager + SDPA,torch.compile + SDPA,opsmath.optimize,opsmath.optimize (every family)}"
# torch's reduce-overhead on the loops opsmath replays as CUDA graphs
step cuda_graphs ${CG_TIMEOUT:-500} $B cuda_graph_loops --variants "torch.compile reduce-overhead"
# FP8: the loss curve against bf16's seed-to-seed noise, and the step time beside torchao's float8
step fp8_curve ${FP8_CURVE_TIMEOUT:-560} $B fp8_curve ${FP8_CURVE_ARGS:---batch 1}
step fp8_speed ${FP8_SPEED_TIMEOUT:-560} $B hf_default_attention --models llama,llama8b4 \
    --variants "torch.compile,opsmath.optimize,opsmath.optimize(fp8=True),torchao float8 + torch.compile" --rounds 4 --steps 3
# sliding-window attention fwd+bwd against SDPA with a mask / flex / compiled eager; BLOOM (ALiBi, its GeLU
# Function compiled by Inductor) and ALiBi attention's alternatives; LLaMA 1.1B's fractional budgets
# planned for Inductor's partition; a Mistral-shaped step with a 1024-key window at sequence 8192
step window ${WINDOW_TIMEOUT:-330} $B attention_variants --kind window --rounds 5
step bloom ${BLOOM_TIMEOUT:-200} $B hf_default_attention --models bloom \
    --variants "torch.compile,opsmath.optimize" --rounds 3 --steps 3
step alibi ${ALIBI_TIMEOUT:-150} $B attention_variants --kind alibi --rounds 3
step memory_llama_fractions ${MLF_TIMEOUT:-400} $B memory --model llama --no-long \
    --paths inductor --fractions ${MLF_FRACTIONS:-0.5,0.25} --absolute "" --no-anchors
step window_model ${WINDOW_MODEL_TIMEOUT:-300} $B hf_default_attention --models mistral_sw --rounds 3 --steps 3
# what the memory plan counts against what a forward leaves allocated (LLaMA 1.1B, no recompute), and
# rowwise FP8 beside tensorwise (both with CUDA-graph replay)
step plan_estimate ${PLAN_ESTIMATE_TIMEOUT:-240} $B plan_estimate --model llama
step fp8_rowwise ${FP8_ROWWISE_TIMEOUT:-400} $B hf_default_attention --models ${FP8_ROWWISE_MODELS:-llama8b4,llama} \
    --variants "opsmath.optimize(fp8=True) + CUDA graphs,opsmath.optimize(fp8=rowwise) + CUDA graphs" --rounds 3 --steps 3
# byte budgets whose first plan holds the step and whose re-plan holds the forward's measured error at the
# forward's end (GPT-2-small; LLaMA 1.1B at 0.65 of its unconstrained peak)
step budget_windows ${BUDGET_WINDOWS_TIMEOUT:-560} bash -c "$B memory --no-long --paths inductor \
    --fractions 0.5,0.25 --absolute ${BW_ABSOLUTE-0.75,0.6} --no-anchors; $B memory --model llama --no-long \
    --paths inductor --fractions '' --absolute 0.65 --no-anchors"
# one BLOOM step with its attention rewrites printed (causal? which bias?) and its kernel times
step bloom_rewrites ${BLOOM_REWRITES_TIMEOUT:-120} $B hf_default_attention --models bloom \
    --variants "opsmath.optimize" --rounds 1 --steps 2
# grouped GEMMs: FP8 by shape (fp8_pays), and opsmath's own Triton kernels (no host sync: what GPUs whose
# PyTorch grouped GEMM is a per-group loop would run) and the fp32 paths of HF's fallback under AMP
step grouped ${GROUPED_TIMEOUT:-400} $B grouped_gemm --rounds 5 --iters 10 \
    --variants "${GROUPED_VARIANTS:-bf16,fp8,own bf16,fp32 per-group mm,fp32 own Triton}" \
    --shapes ${GROUPED_SHAPES:-16384:8:1024:5632,16384:8:4096:14336,32768:64:2048:1408}
# fp32 experts under AMP with the token operand split ahead (the default on sm_90): its tolerance test beside
# tf32x3's, the kernels fwd + bwd, and HF Mixtral at width 2 beside compile and tf32x3 (the default elsewhere)
step fp32_split ${FP32_SPLIT_TIMEOUT:-480} bash -c "python3 -m pytest -q -rfE tests/test_kernel_grouped_mm.py \
    tests/test_kernel_grouped_mm_split.py -k 'tolerance or split'; $B grouped_gemm --rounds 3 --iters 5 \
    --tag=-fp32-split --variants 'fp32 per-group mm,fp32 own Triton,fp32 split ahead' \
    --shapes 8192:8:2048:5632,8192:8:2816:2048; $B fleet --recipes amp --models mixtral --width 2 --rounds 3 \
    --tag=-fp32-split --variants 'torch.compile,opsmath.optimize,opsmath.optimize(fp32 experts tf32x3)'"
# the experts' first GEMM reading its rows through the routing index (opsmath::grouped_mm_gather) against
# the gather then torch's grouped GEMM, per shape (S:G:K:N, top-2 over S/2 tokens), and in MoE training steps
# (about 60 s of first step per variant and model on an H100)
step gather ${GATHER_TIMEOUT:-560} bash -c "$B grouped_gemm --rounds 5 --iters 10 --tag=-gather \
    --variants 'index+bf16 (top-2),gather (top-2)' --shapes ${GATHER_SHAPES:-16384:8:1024:5632,65536:64:1024:1408,16384:16:1024:1024}; \
    $B moe --models ${GATHER_MODELS:-loop} --recipe amp --rounds 3 --steps 3 --tag=-gather \
    --variants 'opsmath.optimize(no gather),opsmath.optimize(gather)'"
# where a cold first step goes (fresh processes, empty caches), stage by stage, torch.compile beside opsmath
# (about 30 and 55 s a model on an H100; --profile adds cProfile runs at about twice that)
step first_step ${FIRST_STEP_TIMEOUT:-560} $B first_step ${FIRST_STEP_ARGS:---models mistral,gpt2}
# fleet rows beside torch.compile, in the recipe users run first and in bf16 weights (models by FLEET_MODELS and
# FLEET_BF16_MODELS, more arguments by FLEET_EXTRA: "--width 2"; each row's first steps run on the caches the steps before left)
step fleet ${FLEET_TIMEOUT:-540} $B fleet --recipes amp --models ${FLEET_MODELS:-gpt2,t5} --rounds ${FLEET_ROUNDS:-3} \
    --deadline-s $(( ${FLEET_TIMEOUT:-540} / 2 )) --tag=${FLEET_TAG:-} ${FLEET_EXTRA:-}
step fleet_bf16 ${FLEET_BF16_TIMEOUT:-540} $B fleet --recipes bf16 --models ${FLEET_BF16_MODELS:-mistral,llama} \
    --rounds ${FLEET_ROUNDS:-3} --deadline-s $(( ${FLEET_BF16_TIMEOUT:-540} / 2 )) --tag=${FLEET_TAG:-} ${FLEET_EXTRA:-}
# what is alive at a step's peak, opsmath beside compile (a row whose peak is over compile's: PEAK_MODEL at width 2)
step peak_snapshot ${PEAK_TIMEOUT:-400} $B peak_snapshot --model ${PEAK_MODEL:-mixtral} --recipe amp --width 2
