"""``python -m daskdist.torchrun``: an unmodified torchrun script on a Dask cluster's workers.

::

    python -m daskdist.torchrun --scheduler tcp://10.0.0.1:8786 train.py --epochs 3

One process per chosen worker runs the script (the worker's replica of a
``MultiWorkerMirroredStrategy``), with torchrun's environment
(``plugins/torch/launch.py``): ``init_process_group()`` (``env://``, gloo on
CPU, NCCL on CUDA), ``init_process_group("gloo")`` and
``init_process_group("daskdist")`` work as under torchrun. Rank 0's output is
streamed back (``--output-ranks`` for others); the exit status is the
script's; a failed rank fails the run with its traceback, and the other
ranks are stopped (``KeyboardInterrupt`` in their script, then their worker
restarted if that did not end it within ``--stop-timeout``). Ctrl-C stops
every rank the same way.

Elastic options: ``--max-restarts N`` runs the script again after a failure,
on the workers alive then (``TORCHELASTIC_RESTART_COUNT`` counts), as
torchrun's agent restarts its worker group; ``--nnodes MIN[:MAX]`` waits for at
least MIN workers and takes at most MAX (a worker is a torchrun "node" of one
process). docs/torch.md says what else maps and what does not.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

__all__ = ["launch", "main", "parse_args"]

logger = logging.getLogger("daskdist.torchrun")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The launcher's options and the script with its arguments (everything after the script's path)."""
    parser = argparse.ArgumentParser(prog="python -m daskdist.torchrun",
                                     description="Run a torchrun script on a Dask cluster's workers.")
    parser.add_argument("--scheduler", required=True, help="the Dask scheduler's address")
    parser.add_argument("--nproc-per-worker", "--nproc-per-node", "--nproc_per_node", type=int, default=1,
                        dest="nproc_per_worker",
                        help="processes per worker: 1 (a replica needs a worker process of its own; start more "
                             "workers per host, dask worker --nworkers N)")
    parser.add_argument("--workers", nargs="+", default=None, metavar="ADDRESS",
                        help="the workers to run on, in rank order (default: every worker)")
    parser.add_argument("--nnodes", default=None, help="MIN[:MAX] workers: wait for MIN, use at most MAX")
    parser.add_argument("--max-restarts", "--max_restarts", type=int, default=0, dest="max_restarts",
                        help="run the script again after a failure, up to this many times")
    parser.add_argument("--output-ranks", default="0",
                        help="ranks whose stdout/stderr is streamed: a comma list, or 'all' (default 0)")
    parser.add_argument("--stop-timeout", type=float, default=10.0,
                        help="seconds a stopped rank has before its worker is restarted (default 10)")
    parser.add_argument("--wait-timeout", type=float, default=60.0,
                        help="seconds to wait for the workers (--nnodes MIN) to be there (default 60)")
    parser.add_argument("script", help="the torchrun script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's arguments")
    args = parser.parse_args(argv)
    if args.nproc_per_worker != 1:
        parser.error(f"--nproc-per-worker {args.nproc_per_worker}: each worker process runs one rank (torch's "
                     "default group is global to a process); start more worker processes per host "
                     "(dask worker --nworkers N --nthreads 1) instead")
    if args.max_restarts < 0:
        parser.error("--max-restarts must be 0 or more")
    args.min_workers, args.max_workers = _nnodes(parser, args.nnodes)
    args.output = None if args.output_ranks == "all" else _ranks(parser, args.output_ranks)
    return args


def _nnodes(parser: argparse.ArgumentParser, value: str | None) -> tuple[int, int | None]:
    if value is None:
        return 1, None
    try:
        low, _, high = value.partition(":")
        lo, hi = int(low), int(high or low)
    except ValueError:
        parser.error(f"--nnodes {value!r}: expected MIN or MIN:MAX (integers)")
    if not 1 <= lo <= hi:
        parser.error(f"--nnodes {value!r}: expected 1 <= MIN <= MAX")
    return lo, hi


def _ranks(parser: argparse.ArgumentParser, value: str) -> list[int]:
    try:
        return [int(r) for r in value.split(",") if r.strip()]
    except ValueError:
        parser.error(f"--output-ranks {value!r}: expected a comma list of ranks or 'all'")


class _Output:
    """Prints the streamed lines of the ranks asked (prefixed ``[rankN]:`` when several), and counts their ends."""

    def __init__(self, ranks: list[int] | None):
        self.prefix = ranks is None or len(ranks) > 1
        self.done: set[int] = set()
        self.lock = threading.Lock()

    def __call__(self, event: tuple[float, Any]) -> None:
        msg = event[1]
        with self.lock:
            if msg.get("done"):
                self.done.add(int(msg["rank"]))
                return
            stream = sys.stderr if msg["stream"] == "stderr" else sys.stdout
            stream.write((f"[rank{msg['rank']}]:" if self.prefix else "") + msg["text"] + "\n")
            stream.flush()

    def wait(self, ranks: set[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not ranks <= self.done:
            time.sleep(0.02)


def _workers(client: Any, args: argparse.Namespace) -> list[str]:
    """The workers of this attempt, in rank order: ``--workers``, else every worker (at least MIN, at most MAX)."""
    from daskdist.cluster.identity import scheduler_workers

    if args.workers:
        client.wait_for_workers(len(args.workers), timeout=args.wait_timeout)
        return list(args.workers)
    client.wait_for_workers(args.min_workers, timeout=args.wait_timeout)
    known = sorted(scheduler_workers(client))
    return known if args.max_workers is None else known[:args.max_workers]


def _stop(client: Any, strategy: Any, run: str, workers: list[str], timeout: float) -> None:
    """Stop every rank's script (``KeyboardInterrupt``), then restart the workers still running it after ``timeout``."""
    from daskdist.plugins.torch.launch import interrupt

    def interrupt_all() -> None:
        try:
            client.run(interrupt, run, workers=workers)
        except Exception as e:  # a worker already gone
            logger.debug("interrupting %s: %s", run, e)

    # a worker whose process is wedged (a thread holding the GIL in C++) never answers: bounded, then restarted
    interrupter = threading.Thread(target=interrupt_all, name="daskdist-torchrun-interrupt", daemon=True)
    interrupter.start()
    interrupter.join(timeout)
    closer = threading.Thread(target=strategy.close, name="daskdist-torchrun-close", daemon=True)
    closer.start()
    closer.join(timeout)
    if closer.is_alive():
        logger.warning("ranks of %s did not stop within %.0f s: restarting their workers", run, timeout)
        client.restart_workers(workers, timeout=max(30.0, timeout), raise_for_error=False)
        closer.join(timeout)


def launch(client: Any, args: argparse.Namespace) -> int:
    """Run ``args.script`` on the chosen workers (again after a failure, up to ``--max-restarts``); its exit status."""
    import daskdist as dd
    from daskdist.cluster_resolver.dask import DaskClusterResolver
    from daskdist.plugins.torch.launch import ScriptFailed, output_topic, run_script

    with open(args.script) as f:
        source = f.read()
    code = 1
    for attempt in range(args.max_restarts + 1):
        run = f"{uuid.uuid4().hex[:12]}"
        output = _Output(args.output)
        client.subscribe_topic(output_topic(run), output)
        workers = _workers(client, args)
        strategy = dd.MultiWorkerMirroredStrategy(cluster_resolver=DaskClusterResolver(client, workers=workers),
                                                  client=client)
        streamed = set(range(len(workers))) if args.output is None else set(args.output) & set(range(len(workers)))
        logger.info("running %s on %d workers (attempt %d)", args.script, len(workers), attempt)
        try:
            strategy.run(run_script, args=(run, args.script, source, list(args.script_args), args.output,
                                           attempt, args.max_restarts))
            output.wait(streamed, 5.0)
            strategy.close()
            return 0
        except KeyboardInterrupt:
            print("daskdist.torchrun: interrupted, stopping every rank", file=sys.stderr)
            _stop(client, strategy, run, workers, args.stop_timeout)
            return 130
        except ScriptFailed as e:
            output.wait(streamed - {e.rank}, 1.0)
            print(f"daskdist.torchrun: rank {e.rank} (worker {workers[e.rank]}) failed with exit code {e.code}:\n"
                  f"{e.report}", file=sys.stderr)
            code = e.code
            _stop(client, strategy, run, workers, args.stop_timeout)
        except Exception as e:  # a worker lost, a rendezvous that failed
            print(f"daskdist.torchrun: the run failed: {type(e).__name__}: {e}", file=sys.stderr)
            code = 1
            _stop(client, strategy, run, workers, args.stop_timeout)
        finally:
            client.unsubscribe_topic(output_topic(run))
        if attempt < args.max_restarts:
            print(f"daskdist.torchrun: restarting ({attempt + 1} of {args.max_restarts})", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: parse, connect to the scheduler, launch; the script's exit status."""
    from distributed import Client

    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="daskdist.torchrun: %(message)s")
    with Client(args.scheduler, set_as_default=False) as client:  # type: ignore[no-untyped-call]
        return launch(client, args)


if __name__ == "__main__":
    sys.exit(main())
