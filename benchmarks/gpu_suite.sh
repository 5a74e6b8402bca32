#!/usr/bin/env bash
# One device call: install, then the STEPS asked for (default: all), each logged to $OUT/<step>.log.
# Run from the repository root; everything lands in $OUT (the device tool brings it back).
#   STEPS="tests attn_tests semantics cuda_graphs attention lce ce dan act train gap recompute memory memory_llama long curve
#          fp8_curve fp8_speed tune llama hf_sdpa lengths guards window_tests window window_model
#          bloom alibi memory_llama_fractions plan_estimate attention_layout fp8_rowwise bloom_rewrites
#          budget_windows"   TESTS=<pytest files>   BENCH_ARGS=<attention.py args>
set -uo pipefail
export PYTHONUNBUFFERED=1 OUT=${OUT:-benchmarks/results}
export OPSMATH_CACHE_DIR=${OPSMATH_CACHE_DIR:-$OUT/opsmath-cache}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
# Liger-Kernel for the memory-bound comparisons: its pure-Python wheel, brought along untracked
# (pip download liger-kernel --no-deps -d benchmarks/wheels; the folder is git-ignored, so pass it to
# the device tool with carry=["benchmarks/wheels"]), installed without dependencies
ls benchmarks/wheels/liger_kernel-*.whl >/dev/null 2>&1 && \
    python3 -m pip install -q --no-deps benchmarks/wheels/liger_kernel-*.whl >> "$OUT/install.log" 2>&1
step() {  # step NAME TIMEOUT CMD...
    local name=$1 limit=$2; shift 2
    case " ${STEPS:-tests attn_tests attention lce ce dan act train gap recompute memory memory_llama long curve tune llama} " in *" $name "*) ;; *) return ;; esac
    echo "== $name"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "rc=$? ($name)"; grep -v -i "warn" "$OUT/$name.log" | tail -${TAIL:-30}
}
# the GPU tests take more than one 10-minute call (2026-11-29: the attention kernel tests alone ran ~10 s
# each, compiling a kernel variant per flag combination), so they are two steps
step tests ${TEST_TIMEOUT:-560} env OPSMATH_TEST_DEVICE=cuda python3 -m pytest -q --tb=short -p no:warnings \
    --durations=10 ${TESTS:-tests/test_models.py tests/test_kernel_dropout_add_norm.py tests/test_inductor.py \
    tests/test_kernel_linear_cross_entropy.py tests/test_patterns_linear_cross_entropy.py \
    tests/test_kernel_cross_entropy.py tests/test_autotune.py tests/test_kernel_activations.py \
    tests/test_patterns_activations.py tests/test_plan.py tests/test_dropout_seeds.py}
step attn_tests ${TEST_TIMEOUT:-560} env OPSMATH_TEST_DEVICE=cuda python3 -m pytest -q --tb=short -p no:warnings \
    --durations=10 tests/test_kernel_attention.py tests/test_attention_tuning.py
# the differential semantics suite in bf16 by the tolerance rule, and the default-attention HF models'
# tests, in SHARDS parallel pytest processes (each compiles its own graphs with Inductor on the CPU cores)
semantics() {
    python3 -m pytest -q --collect-only tests/test_semantics.py tests/test_pieces.py tests/test_dynamic_shapes.py "tests/test_models.py" \
        -k "semantics or pieces or sdpa or dynamic" \
        2>/dev/null | grep "::" > "$OUT/semantics-ids.txt"
    local n=${SHARDS:-6} i pids=()
    for i in $(seq 0 $((n - 1))); do
        awk -v n="$n" -v i="$i" 'NR % n == i' "$OUT/semantics-ids.txt" > "/tmp/shard$i.txt"
        OPSMATH_TEST_DEVICE=cuda python3 -m pytest -q --tb=line -p no:warnings $(cat /tmp/shard$i.txt) \
            > "/tmp/shard$i.log" 2>&1 & pids+=($!)
    done
    wait "${pids[@]}"
    for i in $(seq 0 $((n - 1))); do echo "-- shard $i"; grep -E "passed|failed|FAILED|Error" "/tmp/shard$i.log"; done
}
export -f semantics
step semantics ${SEMANTICS_TIMEOUT:-330} bash -c semantics
step hf_sdpa ${HF_SDPA_TIMEOUT:-540} python3 benchmarks/hf_default_attention.py ${HF_SDPA_ARGS:-}
step lengths ${LENGTHS_TIMEOUT:-540} python3 benchmarks/varying_lengths.py ${LENGTHS_ARGS:-}
step guards ${GUARDS_TIMEOUT:-240} python3 benchmarks/dynamic_guards.py
step attention ${ATTN_TIMEOUT:-420} python3 benchmarks/attention.py ${BENCH_ARGS:-}
step lce 120 python3 benchmarks/linear_cross_entropy.py
step ce 150 python3 benchmarks/cross_entropy.py
step dan 150 python3 benchmarks/dropout_add_norm.py --compile
step act 200 python3 benchmarks/activations.py
step train ${TRAIN_TIMEOUT:-400} python3 benchmarks/train.py --gpt --only "${TRAIN_ONLY:-}"
step gap 240 python3 benchmarks/profile_gap.py --pair "${GAP_PAIR:-torch.compile + SDPA,opsmath.optimize}"
step recompute 200 python3 benchmarks/profile_gap.py --pair "opsmath op-by-op,opsmath budget 0.5" --tag recompute
step memory ${MEMORY_TIMEOUT:-400} python3 benchmarks/memory.py ${MEMORY_ARGS:---quick --paths inductor --no-long}
step memory_llama ${MEMORY_LLAMA_TIMEOUT:-560} python3 benchmarks/memory.py --model llama ${MEMORY_LLAMA_ARGS:---quick --paths inductor --no-long}
step long ${LONG_TIMEOUT:-400} python3 benchmarks/memory.py --long-only ${LONG_ARGS:---variants "opsmath 8GiB SDPA-model" --lengths 65536}
step curve 300 python3 benchmarks/learning_curve.py
step tune 200 python3 -m opsmath.ui.cli tune --example gpt
step llama 500 python3 benchmarks/train.py --llama --only "${LLAMA_ONLY:-eager + SDPA,torch.compile + SDPA,opsmath.optimize,opsmath.optimize (every family)}"
# CUDA graphs in ordinary loops: opsmath's tests, then torch's reduce-overhead on the same loops
step cuda_graphs ${CG_TIMEOUT:-500} bash -c 'OPSMATH_TEST_DEVICE=cuda python3 -m pytest -q --tb=short -p no:warnings \
    tests/test_cuda_graph_loops.py tests/test_inductor.py -k "cuda_graph or guard or static or report" && \
    cd benchmarks && python3 cuda_graph_loops.py --variants "torch.compile reduce-overhead"'
# FP8: the loss curve against bf16's seed-to-seed noise, and the step time beside torchao's float8 (its
# wheel carried in .whl and installed to /tmp/site, as the device README describes)
step fp8_curve ${FP8_CURVE_TIMEOUT:-560} python3 benchmarks/fp8_curve.py ${FP8_CURVE_ARGS:---batch 1}
step fp8_speed ${FP8_SPEED_TIMEOUT:-560} python3 benchmarks/hf_default_attention.py --models llama,llama8b4 \
    --variants "torch.compile,opsmath.optimize,opsmath.optimize(fp8=True),torchao float8 + torch.compile" --rounds 4 --steps 3
# sliding-window attention: the kernel's GPU tests, fwd+bwd against SDPA with a mask / flex / compiled eager,
# and a Mistral-shaped training step with a 1024-key window at sequence 8192
step window_tests ${WINDOW_TESTS_TIMEOUT:-300} env OPSMATH_TEST_DEVICE=cuda python3 -m pytest -q --tb=short -p no:warnings \
    tests/test_kernel_attention_window.py
step window ${WINDOW_TIMEOUT:-330} python3 benchmarks/attention_variants.py --kind window --rounds 5
# BLOOM with its GeLU Function compiled by Inductor, ALiBi attention's alternatives, and LLaMA 1.1B's
# fractional budgets planned for Inductor's partition (the fixes their first GPU runs called for)
step bloom ${BLOOM_TIMEOUT:-200} python3 benchmarks/hf_default_attention.py --models bloom \
    --variants "torch.compile,opsmath.optimize" --rounds 3 --steps 3
step alibi ${ALIBI_TIMEOUT:-150} python3 benchmarks/attention_variants.py --kind alibi --rounds 3
step memory_llama_fractions ${MLF_TIMEOUT:-400} python3 benchmarks/memory.py --model llama --no-long \
    --paths inductor --fractions ${MLF_FRACTIONS:-0.5,0.25} --absolute "" --no-anchors
step window_model ${WINDOW_MODEL_TIMEOUT:-300} python3 benchmarks/hf_default_attention.py --models mistral_sw --rounds 3 --steps 3
# what the memory plan counts against what a forward leaves allocated (LLaMA 1.1B, no recompute), the
# attention kernel on fused-QKV views (the BLOOM step's attention ran ~2x the kernel benchmark's time),
# and rowwise FP8 beside tensorwise (both with CUDA-graph replay)
step plan_estimate ${PLAN_ESTIMATE_TIMEOUT:-240} python3 benchmarks/plan_estimate.py --model llama
step attention_layout ${LAYOUT_TIMEOUT:-90} python3 benchmarks/attention_layout.py
step fp8_rowwise ${FP8_ROWWISE_TIMEOUT:-400} python3 benchmarks/hf_default_attention.py --models ${FP8_ROWWISE_MODELS:-llama8b4,llama} \
    --variants "opsmath.optimize(fp8=True) + CUDA graphs,opsmath.optimize(fp8=rowwise) + CUDA graphs" --rounds 3 --steps 3
# the loss's declared workspace against its measured peak, then byte budgets whose first plan holds it
# and whose re-plan holds the forward's measured error at the forward's end (GPT-2-small; LLaMA 1.1B's
# tight 13.87 GiB, which the timeline's error taken off every point made infeasible)
step budget_windows ${BUDGET_WINDOWS_TIMEOUT:-560} bash -c "OPSMATH_TEST_DEVICE=cuda python3 -m pytest -q -p no:warnings \
    tests/test_kernel_linear_cross_entropy.py -k workspace; python3 benchmarks/memory.py --no-long --paths inductor \
    --fractions 0.5,0.25 --absolute ${BW_ABSOLUTE-0.75,0.6} --no-anchors; python3 benchmarks/memory.py --model llama --no-long \
    --paths inductor --fractions '' --absolute 0.65 --no-anchors"
# one BLOOM step with its attention rewrites printed (causal? which bias?) and its kernel times
step bloom_rewrites ${BLOOM_REWRITES_TIMEOUT:-120} python3 benchmarks/hf_default_attention.py --models bloom \
    --variants "opsmath.optimize" --rounds 1 --steps 2
