#!/usr/bin/env bash
# The two-GPU NCCL sweep behind BENCHMARKS.md's multi-GPU table (any host with 2 CUDA GPUs):
#   bash benchmarks/nccl_sweep.sh [SECONDS]   ->  $OUT (or benchmarks/results)/multi_gpu-nccl-<date>.json
# GPT-2-small: DDP and FSDP2, opsmath vs torch.compile + SDPA, the one-GPU baseline for scaling, and
# the 2-rank vs 1-device parameter check with a DCP checkpoint; HF LLaMA 1.1B: FSDP2 both ways, opsmath
# under a per-rank memory_budget. Runs that no longer fit in SECONDS (default 570) are skipped and say so.
cd "$(dirname "$0")/.." || exit 1   # the repository root: python -m benchmarks
end=$((SECONDS + ${1:-570})); dest=${OUT:-benchmarks/results}; tmp=$(mktemp -d)
export PYTHONUNBUFFERED=1
run() {  # label, most seconds, command...
  local label=$1 limit=$2; shift 2
  local left=$((end - SECONDS))
  if (( left < 40 )); then echo "== $label: skipped, out of time"; return; fi
  (( limit > left )) && limit=$left
  echo "== $label"
  OUT=$tmp/$label timeout "$limit" "$@" > "$tmp/$label.log" 2>&1
  local rc=$?
  grep -E "^\{|^check|Error" "$tmp/$label.log" | grep -v Warning
  (( rc != 0 )) && { echo "rc=$rc"; tail -4 "$tmp/$label.log"; }
}
# the machine itself first: clocks and throttling, and one bf16 GEMM's TFLOP/s per GPU (about 750 on a
# healthy H200), so a slow machine is told apart from a slow program
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,power.draw,power.limit,pstate,clocks_throttle_reasons.active \
  --format=csv 2>&1 | head -4
python - <<'PY'
import torch
for d in range(torch.cuda.device_count()):
    a = torch.randn(8192, 8192, device=f"cuda:{d}", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); [a @ a for _ in range(20)]; e.record(); torch.cuda.synchronize()
    print(f"cuda:{d} bf16 GEMM 8192^3: {20 * 2 * 8192**3 / (s.elapsed_time(e) / 1e3) / 1e12:.0f} TFLOP/s", flush=True)
PY
T="python -m torch.distributed.run --standalone --nproc_per_node=2 -m benchmarks multi_gpu"
run gpt2-ddp-opsmath-check 100 $T --model gpt2 --wrap ddp --variant opsmath --check "$tmp/ck"
run gpt2-1gpu-check 90 python -m benchmarks multi_gpu --model gpt2 --variant opsmath --single --check "$tmp/ck"
run gpt2-ddp-compile 75 $T --model gpt2 --wrap ddp --variant compile
run gpt2-ddp-opsmath 75 $T --model gpt2 --wrap ddp --variant opsmath
run gpt2-1gpu-opsmath 60 python -m benchmarks multi_gpu --model gpt2 --variant opsmath --single --world 1
run gpt2-fsdp-opsmath 75 $T --model gpt2 --wrap fsdp --variant opsmath
run gpt2-fsdp-compile 75 $T --model gpt2 --wrap fsdp --variant compile
run llama-fsdp-opsmath-budget 170 $T --model llama --wrap fsdp --variant opsmath --steps 10 --memory-budget 12GiB
run llama-fsdp-compile 150 $T --model llama --wrap fsdp --variant compile --steps 10
python - "$tmp" "$dest" <<'PY'
import glob, json, os, sys, time
tmp, dest = sys.argv[1:]
rows = {}
for label in sorted(os.listdir(tmp)):
    for f in glob.glob(os.path.join(tmp, label, "*.json")):
        rows[label] = json.load(open(f))
os.makedirs(dest, exist_ok=True)
path = os.path.join(dest, f"multi_gpu-nccl-{time.strftime('%Y%m%d')}.json")
json.dump(rows, open(path, "w"), indent=1)
print("wrote", path, len(rows), "runs")
PY
