"""All-reduce of GPU arrays: daskdist's NCCL engine (cupy) against torch's own NCCL backend, in the same replicas.

One replica per GPU (the embedded ``LocalCUDACluster``). For each size, the
mean time of an all-reduce (SUM, float32) after warm-up: daskdist's
``ReplicaContext.all_reduce`` of a cupy array (the NCCL engine) and torch's
``ProcessGroupNCCL`` (``dist.new_group(backend="nccl")`` beside daskdist's
torch group, met through the same store) on a CUDA tensor. With one GPU both
are one-rank all-reduces: the figures then show each layer's overhead only.

    python benchmarks/gpu_allreduce.py [--sizes 4096,1048576,67108864] [--iterations 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time


def _measure(sizes: list[int], iterations: int) -> list[dict]:
    import cupy
    import torch
    import torch.distributed as dist

    import daskdist as dd

    torch.cuda.set_device(0)
    ctx = dd.get_replica_context()
    dd.plugins.torch.init_process_group()
    nccl = dist.new_group(backend="nccl")
    rows = []
    for size in sizes:
        x = cupy.ones(size // 4, cupy.float32)
        t = torch.ones(size // 4, dtype=torch.float32, device="cuda")
        for _ in range(3):
            ctx.all_reduce("SUM", x)
            dist.all_reduce(t, group=nccl)
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        for _ in range(iterations):
            ctx.all_reduce("SUM", x)
        cupy.cuda.Device().synchronize()
        ours = (time.perf_counter() - start) / iterations
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iterations):
            dist.all_reduce(t, group=nccl)
        torch.cuda.synchronize()
        theirs = (time.perf_counter() - start) / iterations
        rows.append({"bytes": size, "daskdist_us": ours * 1e6, "torch_nccl_us": theirs * 1e6})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,1048576,67108864", help="bytes per all-reduce, comma list")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    import torch

    import daskdist as dd

    gpus = torch.cuda.device_count()
    sizes = [int(s) for s in args.sizes.split(",")]
    with dd.MirroredStrategy(devices=[f"/gpu:{i}" for i in range(gpus)]) as strategy:
        rows = strategy.experimental_local_results(strategy.run(_measure, args=(sizes, args.iterations)))[0]
    for row in rows:
        row["gpus"] = gpus
        row["ratio"] = row["torch_nccl_us"] / row["daskdist_us"]
    print(f"{'bytes':>10} {'daskdist us':>12} {'torch nccl us':>14} {'torch/daskdist':>15}  ({gpus} GPU(s))")
    for row in rows:
        print(f"{row['bytes']:>10} {row['daskdist_us']:>12.1f} {row['torch_nccl_us']:>14.1f} {row['ratio']:>15.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    return rows


if __name__ == "__main__":
    main()
