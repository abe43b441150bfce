"""What the all-reduce benchmarks share: message sizes, the iteration plan, the per-rank timing loop.

Every system (daskdist, MPI, gloo) is timed the same way, *inside* its ranks:
for each message size, a few untimed warm-up all-reduces, then blocks of timed
all-reduces, each block starting with one untimed all-reduce (so that the
ranks enter the timed loop together). Each timed all-reduce is measured with
``time.perf_counter`` on every rank; an iteration's time is the maximum over
the ranks, the figure is the median over iterations.

Peer runners report their per-rank times as one JSON line on stdout, after
``RESULT_MARKER``.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = [
    "RESULT_MARKER",
    "PeerUnavailable",
    "SizePlan",
    "bus_bandwidth",
    "default_iterations",
    "format_size",
    "parse_size",
    "per_iteration_max",
    "plan_from_json",
    "plan_round",
    "plan_to_json",
    "split",
    "standalone_main",
    "time_sizes",
]

#: Peer runners print their result as one line: this marker, then JSON.
RESULT_MARKER = "@@allreduce-result "

_UNITS = {"": 1, "B": 1, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}


class PeerUnavailable(Exception):
    """A peer cannot run here (not installed, failed to start or to finish); ``str(error)`` says why."""


# -- sizes and figures --------------------------------------------------------------


def parse_size(text: str) -> int:
    """``"4KiB"`` -> 4096. Binary (KiB, MiB, GiB) and decimal (KB, MB, GB) units, or plain bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4096, 4KiB, 64MiB)")
    nbytes = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if nbytes <= 0 or nbytes % 4:
        raise argparse.ArgumentTypeError(f"{text!r}: the size must be a positive multiple of 4 bytes (float32)")
    return nbytes


def format_size(nbytes: int) -> str:
    """4096 -> ``"4 KiB"`` (exact binary units where possible)."""
    for unit, factor in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= factor and nbytes % factor == 0:
            return f"{nbytes // factor} {unit}"
    return f"{nbytes} B"


def default_iterations(nbytes: int) -> int:
    """Timed iterations per size (over all rounds): many for small messages, fewer for large ones."""
    if nbytes <= 256 * 2**10:
        return 1000
    if nbytes <= 4 * 2**20:
        return 100
    return 10


def bus_bandwidth(nbytes: int, n: int, seconds: float) -> float:
    """NCCL's bus bandwidth of an all-reduce, in GB/s (1e9 bytes per second)."""
    return 2 * (n - 1) / n * nbytes / seconds / 1e9


# -- the iteration plan ---------------------------------------------------------------


@dataclass
class SizePlan:
    """What one rank does at one message size in one round."""

    nbytes: int
    warmup: int  #: untimed all-reduces first
    blocks: list[int]  #: timed all-reduces per block; each block starts with one untimed all-reduce

    @property
    def iterations(self) -> int:
        return sum(self.blocks)


def split(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal non-negative integers, larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def plan_round(
    sizes: Sequence[int], round_index: int, rounds: int, blocks: int, iterations: int | None = None
) -> list[SizePlan]:
    """The plan of round ``round_index`` of ``rounds``: each size's iterations split across rounds, then blocks.

    ``iterations`` overrides ``default_iterations`` (the total over all rounds).
    Sizes with no iteration left for this round are left out.
    """
    plan = []
    for nbytes in sizes:
        mine = split(iterations or default_iterations(nbytes), rounds)[round_index]
        if mine > 0:
            plan.append(SizePlan(nbytes, warmup=min(3, mine), blocks=split(mine, min(blocks, mine))))
    return plan


def plan_to_json(plan: Sequence[SizePlan]) -> str:
    return json.dumps([asdict(p) for p in plan])


def plan_from_json(text: str) -> list[SizePlan]:
    return [SizePlan(**p) for p in json.loads(text)]


# -- on every rank ----------------------------------------------------------------------


def time_sizes(
    plan: Sequence[SizePlan],
    setup: Callable[[int], Any],
    allreduce: Callable[[Any], None],
    check: Callable[[Any], None],
    before: Callable[[Any], None] | None = None,
    walls: dict[str, float] | None = None,
) -> dict[str, list[float]]:
    """The timing loop every rank of a peer runs; returns this rank's times (seconds) by size (``str(nbytes)``).

    ``setup(nbytes)`` makes the buffers, ``allreduce(state)`` runs one SUM
    all-reduce, ``check(state)`` raises if the last result is wrong and
    ``before(state)``, if given, runs untimed before every all-reduce (to
    restore an input that an in-place all-reduce overwrote). ``walls``, if
    given, gets each size's wall time per all-reduce over the timed blocks,
    the untimed calls between them included (``str(nbytes)``: seconds).
    """
    results: dict[str, list[float]] = {}
    for size in plan:
        state = setup(size.nbytes)

        def untimed() -> None:  # run only in this iteration, before `del state`
            if before is not None:
                before(state)  # noqa: B023, F821
            allreduce(state)  # noqa: B023, F821

        for _ in range(size.warmup):
            untimed()
        times: list[float] = []
        began = time.perf_counter()
        for count in size.blocks:
            untimed()
            for _ in range(count):
                if before is not None:
                    before(state)
                start = time.perf_counter()
                allreduce(state)
                times.append(time.perf_counter() - start)
        if walls is not None:
            walls[str(size.nbytes)] = (time.perf_counter() - began) / max(1, sum(size.blocks) + len(size.blocks))
        check(state)
        results[str(size.nbytes)] = times
        del state
    return results


def per_iteration_max(rank_times: Sequence[dict[str, list[float]]]) -> dict[int, list[float]]:
    """Per size, each iteration's time as the maximum over the ranks."""
    keys = rank_times[0].keys()
    return {int(k): np.max(np.array([r[k] for r in rank_times], dtype=float), axis=0).tolist() for k in keys}


def max_walls(rank_walls: Sequence[dict[str, float]]) -> dict[int, float]:
    """Per size, the wall time per all-reduce of the slowest rank."""
    return {int(k): max(r[k] for r in rank_walls) for k in rank_walls[0]}


def parse_result(stdout: str) -> dict:
    """The JSON a peer printed after ``RESULT_MARKER`` (the last such line)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER):])
    raise ValueError("no result line")


def tail(text: str, lines: int = 6) -> str:
    """The last non-empty ``lines`` of ``text``, joined with `` | `` (for one-line failure reasons)."""
    kept = [line.strip() for line in text.splitlines() if line.strip() and not set(line.strip()) <= set("-")]
    return " | ".join(kept[-lines:]) or "(no output)"


# -- running a peer module alone --------------------------------------------------------


def standalone_main(
    description: str,
    run: Callable[[int, list[SizePlan], argparse.Namespace], dict],
    argv: list[str] | None = None,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
) -> None:
    """Command line of a peer module: ``run(n, plan, args)`` at each rank count, then a table."""
    from _common import format_table  # benchmarks/ is on sys.path (see the peer modules)

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--ranks", nargs="+", type=int, default=[2, 4], help="rank counts (default 2 4)")
    parser.add_argument("--sizes", nargs="+", type=parse_size,
                        default=[parse_size(s) for s in ("4KiB", "256KiB", "4MiB", "64MiB")],
                        help="message sizes (default 4KiB 256KiB 4MiB 64MiB)")
    parser.add_argument("--iterations", type=int, default=None,
                        help="timed iterations per size (default: 1000 up to 256 KiB, 100 up to 4 MiB, else 10)")
    parser.add_argument("--blocks", type=int, default=5, help="blocks per size, each after an untimed all-reduce")
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    rows = []
    for n in args.ranks:
        plan = plan_round(args.sizes, 0, 1, args.blocks, args.iterations)
        try:
            result = run(n, plan, args)
        except PeerUnavailable as error:
            print(f"{n} ranks: unavailable ({error})")
            continue
        print(f"{n} ranks: {result['info']}")
        for nbytes, times in result["times"].items():
            median = float(np.median(times))
            rows.append([str(n), format_size(nbytes), str(len(times)), f"{median * 1e3:.3f}",
                         f"{bus_bandwidth(nbytes, n, median):.3g}"])
    if rows:
        print()
        print(format_table(["ranks", "size", "iters", "median ms", "busbw GB/s"], rows))
        print("\nper iteration: the slowest rank's time; median over iterations; "
              "busbw = 2(n-1)/n * bytes / median (GB/s = 1e9 B/s)")
