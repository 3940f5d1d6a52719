#!/usr/bin/env bash
# The checks that need a GPU, in one call: NCCL, CUDA memory metrics, GPU-only strategy options,
# Accelerate's FSDP and DeepSpeed plugins, and kernel speed. Written for a machine with at least
# one CUDA GPU and a torch CUDA build already installed; every check runs at world size 1 unless
# more GPUs are visible (two ranks on one GPU are not allowed by NCCL).
#
#   bash scripts/gpu_checks.sh [OUT_DIR]        # results in OUT_DIR (default: gpu_checks/)
#
# Each check prints PASS/FAIL and goes on; the summary is OUT_DIR/summary.txt, the run records
# are under OUT_DIR/runs, the kernel benchmark table is OUT_DIR/bench.md, NCCL's collective
# latency and bandwidth OUT_DIR/commbench.md, the timing overhead OUT_DIR/bench_timing.md, the
# sparse product's crossover OUT_DIR/sparse_crossover.md, the fused layer's Triton kernels against the
# fast layer OUT_DIR/bench_fused.md, each run beside the rehearsal's prediction for it OUT_DIR/predicted.md
# (CLUSTER_FILE: the cluster file of the GPU, default configs/clusters/h100_one_node.yaml).
set -u
OUT=${1:-${OUT:-gpu_checks}}
mkdir -p "$OUT/runs"
PY=${PYTHON:-python3}
GPUS=$($PY -c "import torch; print(torch.cuda.device_count())")
NPROC=$(( GPUS >= 2 ? 2 : 1 ))
EXP=configs/experiments/quickstart.yaml
COMMON=(--no-progress --set runtime.device=cuda --set training.steps=40)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

check() {  # check NAME COMMAND...
  local name=$1; shift
  echo "== $name: $*" | tee -a "$OUT/log.txt"
  if "$@" >> "$OUT/log.txt" 2>&1; then echo "PASS $name" | tee -a "$SUMMARY"; else echo "FAIL $name" | tee -a "$SUMMARY"; fi
}

torchrun_train() {  # torchrun_train OUTNAME ARGS...
  local name=$1; shift
  $PY -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m launchers.cli train "$EXP" "${COMMON[@]}" --out "$OUT/runs/$name" "$@"
}

accelerate_train() {  # accelerate_train OUTNAME ACCELERATE_CONFIG ARGS...
  local name=$1 config=$2; shift 2
  $PY -m accelerate.commands.launch --config_file "$config" --num_processes "$NPROC" -m launchers.cli train "$EXP" \
    "${COMMON[@]}" --out "$OUT/runs/$name" --strategy accelerate "$@"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" | tee -a "$OUT/gpu.txt"

check ddp_nccl          torchrun_train ddp --strategy ddp
check fsdp1             torchrun_train fsdp1 --strategy fsdp1
check fsdp1_cpu_offload torchrun_train fsdp1_offload --strategy fsdp1 --set strategy.cpu_offload=true
check fsdp2             torchrun_train fsdp2 --strategy fsdp2
check fsdp2_cpu_offload torchrun_train fsdp2_offload --strategy fsdp2 --set strategy.cpu_offload=true
# training.precision on GPUs: each backend's own mechanism (docs/precision.md); fp16 adds loss scaling
check ddp_bf16          torchrun_train ddp_bf16 --strategy ddp --set training.precision=bf16
check ddp_fp16          torchrun_train ddp_fp16 --strategy ddp --set training.precision=fp16
check fsdp1_bf16        torchrun_train fsdp1_bf16 --strategy fsdp1 --set training.precision=bf16
check fsdp2_bf16        torchrun_train fsdp2_bf16 --strategy fsdp2 --set training.precision=bf16
check zero0_bf16        torchrun_train zero0_bf16 --strategy zero0 --set training.precision=bf16
check zero2_fp16        torchrun_train zero2_fp16 --strategy zero2 --set training.precision=fp16
check accelerate_fp16   accelerate_train acc_fp16 configs/accelerate/ddp.yaml --set training.precision=fp16
# training.compile: step on GPUs (docs/performance.md): compiled autograd under DDP, eager backward
# under FSDP2, and CUDA graphs (reduce-overhead) on the study's model, which is launch-bound there
check ddp_compile_step  torchrun_train ddp_step --strategy ddp --set training.compile=step
check fsdp2_compile_step torchrun_train fsdp2_step --strategy fsdp2 --set training.compile=step
check single_cudagraphs $PY -m launchers.cli train "$EXP" "${COMMON[@]}" --out "$OUT/runs/single_graphs" --strategy single --set training.compile=step \
  --set training.compile_mode=reduce-overhead --set 'model.widths=[2, 64, 1]' --set model.grid=10 \
  --set training.micro_batch=512
# tensor parallelism on NCCL (with one GPU: the DTensor and local_map path at TP degree 1)
check tp                torchrun_train tp --strategy tp
check tp_bf16           torchrun_train tp_bf16 --strategy tp --set training.precision=bf16
check fsdp2_tp          torchrun_train fsdp2_tp --strategy fsdp2_tp --set strategy.tp_degree="$NPROC"
# hybrid sharding over NCCL: shard groups of 1 rank, so 2 GPUs make a real replicate x shard mesh
check hsdp              torchrun_train hsdp --strategy hsdp --set strategy.shard_degree=1
check fsdp1_hybrid      torchrun_train fsdp1_hybrid --strategy fsdp1_hybrid --set strategy.shard_degree=1
# ZeRO++: hpZ at the GPUs there are, and the quantized collectives the CPU accelerator refuses
check zero3_hpz_quantized torchrun_train zero3_hpz_q --strategy zero3_hpz --set strategy.hpz_partition_size="$NPROC" \
  --set strategy.quantized_weights=true --set strategy.quantized_gradients=true

# activation checkpointing on CUDA (docs/memory.md): the counted step's activations beside the
# allocator's peak, with and without, under a strategy of each kind
for s in ddp fsdp2 zero3; do
  check "${s}_checkpointed" torchrun_train "${s}_ac" --strategy "$s" --set model.family=rbf \
    --set 'model.widths=[32, 512, 512, 512, 1]' --set task.name=high_dim --set task.dim=32 \
    --set training.micro_batch=2048 --set training.activation_checkpointing=layers
done
check zero2             torchrun_train zero2 --strategy zero2
check zero3_offload     torchrun_train zero3_offload --strategy zero3_offload
check accelerate_ddp    accelerate_train acc_ddp configs/accelerate/ddp.yaml
check accelerate_fsdp1  accelerate_train acc_fsdp1 configs/accelerate/fsdp1.yaml
check accelerate_fsdp2  accelerate_train acc_fsdp2 configs/accelerate/fsdp2.yaml
check accelerate_zero3  accelerate_train acc_zero3 configs/accelerate/deepspeed_zero3.yaml

# Every record: NCCL backend, CUDA peak memory present, the distributed type Accelerate ran, and
# a low precision really computed in.
check records $PY - "$OUT/runs" <<'PYEOF'
import sys
from pathlib import Path
from analysis.records.run_files import read_summary
bad = 0
for summary in sorted(Path(sys.argv[1]).glob("*/*/summary.json")):
    r = read_summary(summary)
    ok = r.status == "ok" and r.topology.comm_backend == "nccl" and (r.memory.peak_device_bytes or 0) > 0
    ok = ok and (r.precision.setting == "fp32" or r.precision.compute_dtype in ("bfloat16", "float16"))
    # the counted step's tensors and FLOPs, where a step was counted (eager runs)
    counted = r.compile.setting != "none" or (r.memory is not None and r.memory.step_peak is not None and r.flops is not None)
    ok = ok and counted
    bad += not ok
    print(f"{'ok ' if ok else 'BAD'} {summary.parent.parent.name:14s} {r.strategy.label:18s} "
          f"{r.throughput.samples_per_s if r.throughput else 0:12,.0f} samples/s  peak {r.memory.peak_device_bytes if r.memory else None} B  "
          f"comm {100 * (r.comm_overhead or 0):.1f}%  loss {r.final_loss}  {r.precision.setting}: {r.precision.mechanism}, "
          f"computed in {r.precision.compute_dtype}  activations {r.memory.activations_after_forward_bytes if r.memory else None} B "
          f"({r.memory.activation_checkpointing if r.memory else None})  model {r.flops.model_per_sample if r.flops else None} FLOP/sample")
sys.exit(1 if bad else 0)
PYEOF

# What kanscale recommend predicts for each run above (its strategy rehearsed at the run's layout, its
# kernels costed on the GPU of CLUSTER_FILE), beside what the run measured: OUT_DIR/predicted.md
CLUSTER_FILE=${CLUSTER_FILE:-configs/clusters/h100_one_node.yaml}
predicted_beside_measured() {
  $PY scripts/predicted_beside_measured.py "$OUT/runs" --cluster "$CLUSTER_FILE" --out "$OUT/predicted" > "$OUT/predicted.md" \
    && cat "$OUT/predicted.md"
}
check predicted_beside_measured predicted_beside_measured

check commbench_nccl $PY -m launchers.cli commbench --device cuda --nproc-per-node "$NPROC" --out "$OUT/commbench.json"
# Kernel speed: the study's, the wide and the fine-grid workloads, with the whole step compiled and
# the sparse product (whose crossover with the dense one is not measured on GPUs yet)
check bench $PY -m launchers.cli bench --models study,wide,fine \
  --impl pykan,pykan+compile,reference,fast,fast+compile,fast+step,fast-dense,fast-sparse,mlp --out "$OUT/bench.json"
# The fused layer's Triton kernels compiled for this GPU: parity with the fast layer (float64, float32,
# bf16; a skipped test is a failure here: it means no CUDA or no triton), then their speed against it,
# eager and with the whole step compiled; the table is OUT_DIR/bench_fused.md
fused_triton_parity() {
  $PY -m pytest -q -rs -p no:cacheprovider tests/test_bspline_triton.py -k cuda_fused > "$OUT/fused_triton.log" 2>&1
  local rc=$?
  cat "$OUT/fused_triton.log"
  [ "$rc" -eq 0 ] && ! grep -q skipped "$OUT/fused_triton.log"
}
check fused_triton_parity fused_triton_parity
check bench_fused $PY -m launchers.cli bench --device cuda --models study,wide --impl fast,fused,fast+step,fused+step \
  --out "$OUT/bench_fused.json"
# Does the suite's clock (CUDA events, one synchronize per window) slow the training? Its DDP rate
# against a hand-written DDP loop, interleaved; the table is OUT_DIR/bench_timing.md.
bench_timing() {
  $PY -m torch.distributed.run --standalone --nproc_per_node "$NPROC" scripts/bench_timing.py --device cuda --rounds 5 \
    --out "$OUT/bench_timing.json" > "$OUT/bench_timing.log" && grep '^|' "$OUT/bench_timing.log" > "$OUT/bench_timing.md"
}
check bench_timing bench_timing
# The sparse product's crossover with the dense one on this GPU (product: auto takes a crossover measured on CPUs only);
# the table is OUT_DIR/sparse_crossover.md
sparse_crossover() {
  $PY scripts/bench_sparse_crossover.py --device cuda --grids 10 40 80 160 320 > "$OUT/sparse_crossover.md"
}
check sparse_crossover sparse_crossover
cat "$SUMMARY"
