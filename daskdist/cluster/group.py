"""The client's handle on a replica group: launch, send commands, gather answers, close.

Launching submits one long-lived task per chosen worker (pinned, all at
once) and waits at the scheduler plugin until every replica has met. After
that, every command goes straight from the client to the replicas' workers
through the client's connection pool; the scheduler is not involved.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from typing import Any, Callable, Sequence

from distributed import Client, Future
from distributed.comm.core import CommClosedError

from daskdist import config, serialization
from daskdist.cluster.interrupts import abort_interrupted_run
from daskdist.cluster.placement import Placement
from daskdist.cluster.scheduler_plugin import DaskdistSchedulerPlugin
from daskdist.collective.nccl import parse_setting
from daskdist.exceptions import RendezvousError, ReplicaLostError, StrategyClosedError
from daskdist.replica.runtime import GroupSpec, replica_main

__all__ = ["ReplicaGroup"]

logger = logging.getLogger(__name__)

#: When several replicas fail, the error the client raises is the first kind in this order.
_ERROR_PRIORITY = ("lost", "user", "mismatch", "timeout", "aborted")


class ReplicaGroup:
    """Replicas of one strategy on a Dask cluster.

    Parameters
    ----------
    client
        A synchronous ``distributed.Client`` connected to the cluster.
    placements
        Rank -> worker, from ``place_replicas``.
    spec_options
        Extra ``GroupSpec`` fields (algorithm, options, transport); ``nccl``
        defaults to ``daskdist.collective.nccl`` as read here.
    """

    def __init__(self, client: Client, placements: list[Placement], **spec_options: Any):
        if getattr(client, "asynchronous", False):
            raise TypeError("daskdist strategies need a synchronous Client (asynchronous=False)")
        self.client = client
        self.placements = placements
        self.group_id = f"daskdist-{uuid.uuid4().hex[:12]}"
        spec_options.setdefault("nccl", config.get("collective.nccl", "auto"))
        parse_setting(spec_options["nccl"])  # a bad value fails here, not on the workers
        self.spec = GroupSpec(
            group_id=self.group_id,
            addresses=[p.address for p in placements],
            devices=[p.device.to_string() for p in placements],
            **spec_options,
        )
        self.futures: list[Future] = []
        self.failure: BaseException | None = None
        self.closed = False
        self._run_ids = itertools.count(1)
        self._lock = threading.Lock()
        #: Runs that failed so far; sent with every run so that all replicas re-make their NCCL
        #: communicator together after a failure (``Communicator.set_generation``).
        self.failed_runs = 0

    @property
    def size(self) -> int:
        return len(self.placements)

    @property
    def addresses(self) -> list[str]:
        return self.spec.addresses

    # -- lifecycle ---------------------------------------------------------------

    def launch(self) -> None:
        """Install the plugins, start one replica task per worker, and wait for the rendezvous."""
        self.client.register_plugin(DaskdistSchedulerPlugin(), name="daskdist")
        response = self.client.sync(
            self.client.scheduler.daskdist_register_group,
            group_id=self.group_id,
            workers=self.addresses,
            client=self.client.id,
        )
        if response.get("status") != "OK":
            raise ValueError(response.get("message"))
        for rank, address in enumerate(self.addresses):
            self.futures.append(
                self.client.submit(
                    replica_main,
                    self.spec,
                    rank,
                    key=f"{self.group_id}-replica-{rank}",
                    workers=[address],
                    allow_other_workers=False,
                    pure=False,
                )
            )
        timeout = config.get_seconds("rendezvous.timeout")
        deadline = time.monotonic() + timeout
        while True:
            # wait at the scheduler in short slices, so a replica task that fails at start-up is seen at once
            slice_ = max(0.01, min(0.5, deadline - time.monotonic()))
            response = self.client.sync(
                self.client.scheduler.daskdist_wait_group, group_id=self.group_id, timeout=slice_, final=False
            )
            if response.get("status") == "OK":
                break
            failed = [(i, f) for i, f in enumerate(self.futures) if f.status == "error"]
            if failed:
                rank, future = failed[0]
                error = future.exception()  # before the release, which forgets the future's error
                self._release()
                raise RendezvousError(f"replica {rank} failed to start on {self.addresses[rank]}: {error!r}") from error
            if response.get("status") == "failed" or time.monotonic() >= deadline:
                final = self.client.sync(
                    self.client.scheduler.daskdist_wait_group, group_id=self.group_id, timeout=0.01, final=True
                )
                self._release()
                raise RendezvousError(final.get("message", "rendezvous failed"))
        logger.debug("Replica group %s is up on %s", self.group_id, self.addresses)

    def close(self, timeout: float = 30) -> None:
        """Stop every replica, wait for their tasks to end, and forget the group everywhere.

        Replicas whose worker has left the cluster are skipped: their task
        can never finish, and the scheduler forgets it when released. That
        includes workers that die while the others stop (a close right after
        a crash, before the scheduler has noticed it).
        """
        if self.closed:
            return
        self.closed = True
        try:
            ranks = self._ranks_alive(range(self.size))
            self.client.sync(self._stop, ranks)
            deadline = time.monotonic() + timeout
            while ranks:
                try:
                    self.futures[ranks[0]].result(timeout=min(0.5, max(0.1, deadline - time.monotonic())))
                    ranks.pop(0)
                except TimeoutError:
                    if time.monotonic() >= deadline:
                        raise
                    ranks = self._ranks_alive(ranks)
        except Exception as e:  # the cluster may already be gone, or a replica is stuck in user code
            logger.warning("Replicas of %s did not all stop cleanly: %r", self.group_id, e)
        self._release()

    def _ranks_alive(self, ranks: Any) -> list[int]:
        """Those of ``ranks`` whose worker is still in the cluster."""
        alive = set(self.client.scheduler_info(n_workers=-1)["workers"])
        return [r for r in ranks if self.addresses[r] in alive]

    def _release(self) -> None:
        try:
            self.client.sync(self.client.scheduler.daskdist_close_group, group_id=self.group_id)
        except Exception as e:
            logger.debug("Closing group %s at the scheduler: %s", self.group_id, e)
        for future in self.futures:
            future.release()
        self.futures = []

    async def _stop(self, ranks: list[int]) -> None:
        async def stop(rank: int) -> None:
            try:
                await asyncio.wait_for(
                    self.client.rpc(self.addresses[rank]).daskdist_stop(group_id=self.group_id, rank=rank), 10
                )
            except (OSError, CommClosedError, asyncio.TimeoutError) as e:
                logger.debug("Could not stop replica %d of %s: %r", rank, self.group_id, e)

        await asyncio.gather(*(stop(r) for r in ranks))

    # -- commands ----------------------------------------------------------------

    def call(self, command: Callable[..., Any], args_per_replica: Sequence[tuple] | tuple = (),
             ranks: Sequence[int] | None = None) -> list[Any]:
        """Run ``command(runtime, *args)`` on replicas; return their results in rank order.

        Parameters
        ----------
        args_per_replica
            One argument tuple for all replicas, or a list with one tuple per replica.
        ranks
            Only these replicas (default: all). Commands that use collectives
            must go to all.

        Raises
        ------
        StrategyClosedError
            The group was closed or has failed.
        Exception
            The root cause when replicas fail: a lost replica first, then the
            user's own exception, then mismatches, timeouts, aborts.
        """
        if self.closed:
            raise StrategyClosedError("This strategy is closed; create a new one")
        if self.failure is not None:
            raise StrategyClosedError(
                f"This strategy's replica group failed and cannot run more work ({self.failure}); "
                "create a new strategy"
            ) from self.failure
        ranks = list(range(self.size)) if ranks is None else list(ranks)
        with self._lock:  # the failure count in the payload must be the one this run starts with
            generation = self.failed_runs
            if isinstance(args_per_replica, tuple):
                shared = serialization.dumps((command, args_per_replica, generation))
                payloads = {r: shared for r in ranks}
            else:
                payloads = {r: serialization.dumps((command, tuple(args_per_replica[r]), generation)) for r in ranks}
            run_id = next(self._run_ids)
            try:
                responses = self.client.sync(self._call_all, run_id, payloads)
            except BaseException as e:
                self.failed_runs += 1
                if not isinstance(e, Exception):  # Ctrl-C, SystemExit: the replicas must not go on without us
                    abort_interrupted_run(self.client, self.addresses, self.group_id, ranks, run_id, e)
                raise
            if any(r is None or r.get("status") != "OK" for r in responses.values()):
                self.failed_runs += 1
        return self._results(responses, ranks)

    async def _call_all(self, run_id: int, payloads: dict[int, bytes]) -> dict[int, dict | None]:
        tasks = {asyncio.ensure_future(self._call_one(rank, run_id, payload)): rank for rank, payload in payloads.items()}
        responses: dict[int, dict | None] = {rank: None for rank in payloads}
        pending = set(tasks)
        failed = lost = False
        while pending and not failed:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                response = responses[tasks[task]] = task.result()
                failed |= response.get("status") != "OK"
                lost |= response.get("kind") == "lost"
        if pending and not lost:  # a replica failed: give the others a bounded time to report why
            done, pending = await asyncio.wait(pending, timeout=config.get_seconds("client.abort-grace"))
            for task in done:
                responses[tasks[task]] = task.result()
        for task in pending:  # a lost group is dead: nothing the others say changes the outcome
            task.cancel()
        return responses

    async def _call_one(self, rank: int, run_id: int, payload: bytes) -> dict:
        address = self.addresses[rank]
        try:
            return await self.client.rpc(address).daskdist_call(
                group_id=self.group_id, rank=rank, run_id=run_id, payload=payload
            )
        except (OSError, CommClosedError) as e:
            error = ReplicaLostError(
                f"replica {rank} was lost: the connection to its worker {address} failed ({e})", worker=address
            )
            return serialization.error_message(error, rank, address)

    def _results(self, responses: dict[int, dict | None], ranks: list[int]) -> list[Any]:
        errors = [r for r in responses.values() if r is not None and r.get("status") != "OK"]
        if not errors:
            return [serialization.loads(responses[r]["result"]) for r in ranks]
        errors.sort(key=lambda m: _ERROR_PRIORITY.index(m["kind"]) if m["kind"] in _ERROR_PRIORITY else 99)
        root = errors[0]
        error = serialization.exception_from_message(root)
        silent = [r for r, m in responses.items() if m is None]
        if silent:
            error.add_note(
                f"replicas {silent} did not answer within daskdist.client.abort-grace after the failure "
                "(still busy in user code?)"
            )
        if root["kind"] == "lost":
            self.failure = error
        raise error
