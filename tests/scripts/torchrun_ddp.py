"""A DDP training script written for torchrun (nothing of daskdist in it): tests/test_torchrun.py runs it unchanged.

    torchrun --nproc-per-node 2 tests/scripts/torchrun_ddp.py --out /tmp/params
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def hold(args, rank):
    """Wait (Ctrl-C ends it), then say how it ended."""
    open(f"{args.out}.ready.{rank}", "w").close()
    try:
        deadline = time.monotonic() + args.hold
        while time.monotonic() < deadline:
            time.sleep(0.05)
    except KeyboardInterrupt:
        open(f"{args.out}.interrupted.{rank}", "w").close()
        raise


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default=None, help="init_process_group's backend (default: torch's choice)")
    parser.add_argument("--out", required=True, help="each rank writes its parameters to OUT.RANK")
    parser.add_argument("--fail-rank", type=int, default=-1, help="this rank raises after training")
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--fail-once", action="store_true", help="--fail-rank fails on torchrun's first attempt only")
    parser.add_argument("--hold", type=float, default=0, help="after init, write OUT.ready.RANK and wait this long")
    args = parser.parse_args()
    if args.backend is None:
        dist.init_process_group()  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
    else:
        dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) == (rank, world)
    if args.hold:
        hold(args, rank)
    torch.set_num_threads(1)
    torch.manual_seed(rank)  # different starting weights: DDP broadcasts rank 0's
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=generator)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=False))
    for xb, yb in loader:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        optimizer.step()
    with open(f"{args.out}.{rank}", "w") as f:
        json.dump([p.detach().tolist() for p in model.module.parameters()], f)
    carrier = dist.get_backend()
    if carrier == "undefined":  # init_process_group() without a backend: one per device type, gloo for CPU tensors
        carrier = type(dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))).__name__
    print(f"rank {rank} of {world} trained on {carrier}")
    del model, optimizer  # before the group: torch's ~ProcessGroupGloo joins its threads holding the GIL
    dist.destroy_process_group()
    if rank == args.fail_rank and not (args.fail_once and os.environ["TORCHELASTIC_RESTART_COUNT"] != "0"):
        raise ValueError(f"rank {rank} fails on purpose")
    sys.exit(args.exit_code)


if __name__ == "__main__":
    main()
