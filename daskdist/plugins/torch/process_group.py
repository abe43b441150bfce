"""``ProcessGroupDaskdist``: a ``torch.distributed.ProcessGroup`` whose collectives are daskdist's.

A Python subclass of ``dist.ProcessGroup`` (torch's ``PyProcessGroup``
trampoline): torch's C++ callers (DDP's reducer, ``SyncBatchNorm``, ZeRO) and
``torch.distributed``'s functions reach these methods. Tensors travel as numpy
views of their memory (no copy for contiguous CPU tensors); an all-reduce
reduces a contiguous tensor where it lies (``in_place``: no result buffer, no
copy back), other results are copied back in place.

Two paths. A call of torch's Python API with ``async_op=False`` (``opts.asyncOp``
false: torch waits for the work at once) runs in the calling thread, raises
its own error there, and returns one shared completed work (``_DONE``): no
per-call work, future or closure. Every other call (``async_op=True``, and
torch's C++ callers: DDP's reducer, ``SyncBatchNorm``, ZeRO) returns a
``DaskdistWork`` made from a ``torch.futures.Future`` that the adapter
(``comm.ReplicaComm``) completes, inline or on the group's communication
thread. CUDA tensors go to a torch NCCL process group made through the same
store (``nccl_group``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from daskdist.ops import ReduceOp
from daskdist.plugins.torch.comm import Outcome, ReplicaComm

__all__ = ["BACKEND_NAME", "SUPPORTED", "DaskdistWork", "ProcessGroupDaskdist"]  # noqa: RUF022 - constants first

logger = logging.getLogger(__name__)

BACKEND_NAME = "daskdist"

#: the operations of ``torch.distributed`` this backend carries (named in the error of any other)
SUPPORTED = ("all_reduce (SUM, AVG, MIN, MAX, PRODUCT)", "all_reduce_coalesced", "broadcast", "all_gather",
             "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "reduce", "gather", "scatter",
             "all_to_all_single", "barrier", "send", "recv", "new_group")

_SUM = dist.ReduceOp.SUM
_OPS = ((dist.ReduceOp.SUM, ReduceOp.SUM), (dist.ReduceOp.AVG, ReduceOp.MEAN), (dist.ReduceOp.MIN, ReduceOp.MIN),
        (dist.ReduceOp.MAX, ReduceOp.MAX), (dist.ReduceOp.PRODUCT, ReduceOp.PRODUCT))


class DaskdistWork(dist._Work):  # type: ignore[misc]
    """The work of one collective: done when the adapter completes its future; ``wait`` raises its error.

    (torch's ``_create_work_from_future`` makes a work whose ``wait`` swallows
    the future's exception: a failed collective would look done.) ``wait``
    raises the collective's own exception (``outcome.error``); torch's C++
    callers see the future fail with its message.
    """

    def __init__(self, outcome: Outcome):
        super().__init__()
        self._outcome = outcome

    def wait(self, timeout: Any = None) -> bool:
        future = self._outcome.future
        if future is None:  # ran inline and succeeded
            return True
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout or 0)
        if seconds > 0:
            deadline = time.monotonic() + seconds
            while not future.done():
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"daskdist collective did not finish within {seconds:g} s")
                time.sleep(0.0005)
        try:
            future.wait()
        except Exception:
            if self._outcome.error is not None:
                raise self._outcome.error from None
            raise
        return True

    def get_future(self) -> torch.futures.Future:
        return self._outcome.torch_future()

    def is_completed(self) -> bool:
        future = self._outcome.future
        return future is None or bool(future.done())

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self) -> Any:
        future = self._outcome.future
        if future is None or not future.done():
            return None
        if self._outcome.error is not None:
            return self._outcome.error
        try:
            future.wait()
        except Exception as e:
            return e
        return None

    def result(self) -> Any:
        self.wait()
        return self._outcome.torch_future().value()


def _op_name(op: Any) -> ReduceOp:
    if op == _SUM:  # the common case first
        return ReduceOp.SUM
    for torch_op, name in _OPS:
        if op == torch_op:
            return name
    raise ValueError(f"the daskdist backend reduces with SUM, AVG, MIN, MAX or PRODUCT; got {op}")


def _view(tensor: torch.Tensor) -> np.ndarray:
    """The numpy view of a CPU tensor's memory (no copy; strided tensors keep their strides)."""
    if tensor.is_cpu and tensor.dtype in _CARRIED:  # the common case first: a call costs microseconds
        return (tensor.detach() if tensor.requires_grad else tensor).numpy()
    if tensor.device.type != "cpu":
        raise ValueError(f"the daskdist backend carries CPU tensors (CUDA ones go through NCCL, all of one call "
                         f"on one device); got {tensor.device}")
    raise TypeError(f"the daskdist backend carries float16/32/64, integer and bool tensors; got {tensor.dtype}")


_CARRIED = frozenset({torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32,
                      torch.int64, torch.bool})


def _results_into(views: list[np.ndarray], result: Any) -> None:
    """Copy an all-reduce's results into the tensors' views, except those it reduced where they lie (in place)."""
    for v, r in zip(views, (result,) if len(views) == 1 else result):
        if not np.may_share_memory(v, r):
            np.copyto(v, r, casting="no")  # the same shape and dtype: checked by the collective


def _sync(opts: Any) -> bool:
    """Whether torch's Python API made this call with ``async_op=False`` (it waits for the work at once).

    Such a call runs here, in the calling thread (after the async work issued
    before it), raises its own error here, and returns ``_DONE``. torch's C++
    callers (DDP's reducer, ``_broadcast_coalesced``) leave ``asyncOp`` at its
    default, ``True``, and get a work of their own.
    """
    return opts is not None and not opts.asyncOp


class _DoneWork(dist._Work):  # type: ignore[misc]
    """The completed work of every synchronous call: torch's wrapper only ``wait()``s it and drops it."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> Any:
        return None

    def get_future(self) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(None)
        return future


def _done_work() -> Any:
    """One completed work shared by every synchronous call (no work made per call)."""
    return _DoneWork()


_DONE = _done_work()


def _copy_into(tensor: torch.Tensor, array: np.ndarray) -> None:
    np.copyto(_view(tensor), np.asarray(array).reshape(tuple(tensor.shape)), casting="no")


class ProcessGroupDaskdist(dist.ProcessGroup):  # type: ignore[misc]
    """The process group of the replicas of one daskdist group generation (or a subgroup of them).

    Parameters
    ----------
    comm
        The replica's collectives (``ReplicaComm``), shared with subgroups.
    rank, size
        This replica's rank in this group and the group's size.
    ranks
        The global ranks of the group's members (``None``: every replica).
    """

    def __init__(self, comm: ReplicaComm, rank: int, size: int):
        super().__init__(rank, size)
        self._comm = comm
        self._rank = rank
        self._size = size
        self._group_name = ""
        self._group_desc = ""
        self._store: Any = None  # the group's torch Store (DaskdistStore): NCCL's rendezvous for CUDA tensors
        self._nccl_group: Any = None

    # -- identity ---------------------------------------------------------------

    def getBackendName(self) -> str:  # noqa: N802 - torch's names
        return BACKEND_NAME

    def getRank(self) -> int:  # noqa: N802
        return self._rank

    def getSize(self) -> int:  # noqa: N802
        return self._size

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    def name(self) -> str:
        return BACKEND_NAME

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def abort(self) -> None:
        self._comm.close()

    def shutdown(self) -> None:
        self._comm.close()

    def __repr__(self) -> str:
        return f"<ProcessGroupDaskdist rank={self._rank} size={self._size} name={self._group_name!r}>"

    # -- CUDA tensors: torch's NCCL through the same store ---------------------------------

    def _nccl(self) -> Any:
        """torch's ``ProcessGroupNCCL`` for this group, made on first use through the group's store (no port)."""
        if self._nccl_group is None:
            if self._store is None or not hasattr(dist, "ProcessGroupNCCL"):
                raise ValueError("CUDA tensors need torch's NCCL backend (a CUDA build of torch) and a group made "
                                 "by dd.plugins.torch.init_process_group()")
            store = dist.PrefixStore(f"nccl/{self._group_name}/", self._store)
            self._nccl_group = dist.ProcessGroupNCCL(store, self._rank, self._size)
        return self._nccl_group

    def _on_cuda(self, tensors: Any) -> bool:
        first = tensors
        while isinstance(first, (list, tuple)):
            if not first:
                return False
            first = first[0]
        return isinstance(first, torch.Tensor) and first.device.type == "cuda"

    # -- machinery ----------------------------------------------------------------

    def _work(self, call: Any, finish: Callable[[Any], Any], opts: Any = None) -> Any:
        """Run ``call`` (``(group, async_op) -> result``): at once when torch's Python API waits for it
        (``_sync``), else as a ``DaskdistWork`` (on the communication thread, or inline)."""
        if _sync(opts):
            finish(self._comm.call(call))
            return _DONE
        return DaskdistWork(self._comm.run(call, finish))

    def new_group(self, ranks: list[int], timeout: Any = None, pg_options: Any = None, group_name: str | None = None,
                  group_desc: str | None = None) -> ProcessGroupDaskdist | None:
        """torch's ``dist.new_group`` (every rank calls it): a subgroup of daskdist's process group, or ``None``."""
        sub = self._comm.subgroup(sorted(int(r) for r in ranks), group_name)
        if sub is None:
            return None
        pg = ProcessGroupDaskdist(sub, sub.group.rank, sub.group.size)
        pg._set_group_name(group_name or "")
        pg._set_group_desc(group_desc or "")
        pg._store = self._store
        return pg

    # -- collectives ----------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        """All-reduce in place: a contiguous tensor is reduced where it lies (no result buffer, no copy back)."""
        if opts is not None and not opts.asyncOp and len(tensors) == 1:  # ``_sync``: the latency path, inlined
            tensor = tensors[0]
            if tensor.is_cpu and tensor.dtype in _CARRIED and not tensor.requires_grad:
                view = tensor.numpy()
                result = self._comm.all_reduce_now(_op_name(opts.reduceOp), view, None, True)
                if not np.may_share_memory(view, result):
                    np.copyto(view, result, casting="no")
                return _DONE
        if tensors and tensors[0].is_cuda:
            return self._nccl().allreduce(tensors, opts)
        op = _op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        views = [_view(t) for t in tensors]
        value: Any = views[0] if len(views) == 1 else views
        if _sync(opts):
            _results_into(views, self._comm.group.all_reduce(op, value, in_place=True))
            return _DONE

        def finish(result: Any) -> list[torch.Tensor]:
            _results_into(views, result)
            return tensors

        return self._work(lambda g, a: g.all_reduce(op, value, async_op=a, in_place=True), finish)

    allreduce_coalesced = allreduce

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        if self._on_cuda(tensors):
            return self._nccl().broadcast(tensors, opts)
        views = [_view(t) for t in tensors]
        root = int(opts.rootRank)

        def finish(result: Any) -> list[torch.Tensor]:
            if self._rank != root:
                for t, r in zip(tensors, result):
                    _copy_into(t, r)
            return tensors

        return self._work(lambda g, a: g.broadcast(views, root, async_op=a), finish, opts)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        if self._on_cuda(inputs):
            return self._nccl().allgather(output_lists, inputs, opts)
        views = [_view(t)[None] for t in inputs]

        def finish(result: Any) -> list[list[torch.Tensor]]:
            for outputs, gathered in zip(output_lists, result):
                for t, part in zip(outputs, gathered):
                    _copy_into(t, part)
            return output_lists

        return self._work(lambda g, a: g.all_gather(views, 0, async_op=a), finish, opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        if self._on_cuda(inputs):
            return self._nccl().allgather_into_tensor_coalesced(outputs, inputs, opts)
        views = [_view(t).reshape((1, -1)) for t in inputs]

        def finish(result: Any) -> list[torch.Tensor]:
            for t, r in zip(outputs, result):
                _copy_into(t, r)
            return outputs

        return self._work(lambda g, a: g.all_gather(views, 0, async_op=a), finish, opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> Any:
        if self._on_cuda(outputs):
            return self._nccl().reduce_scatter(outputs, input_lists, opts)
        op = _op_name(opts.reduceOp)
        stacked = [np.stack([_view(t) for t in parts]) for parts in input_lists]

        def finish(result: Any) -> list[torch.Tensor]:
            for t, r in zip(outputs, result):
                _copy_into(t, r)
            return outputs

        return self._work(lambda g, a: g.reduce_scatter(op, stacked, 0, async_op=a), finish, opts)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:  # noqa: A002
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any) -> Any:
        if self._on_cuda(inputs):
            return self._nccl().reduce_scatter_tensor_coalesced(outputs, inputs, opts)
        op = _op_name(opts.reduceOp)
        for o, i in zip(outputs, inputs):
            if i.numel() != o.numel() * self._size:
                raise ValueError(f"reduce_scatter_tensor needs an input of world size x the output's elements: "
                                 f"input {list(i.shape)}, output {list(o.shape)}, world size {self._size}")
        views = [_view(t).reshape((self._size, -1)) for t in inputs]

        def finish(result: Any) -> list[torch.Tensor]:
            for t, r in zip(outputs, result):
                _copy_into(t, r)
            return outputs

        return self._work(lambda g, a: g.reduce_scatter(op, views, 0, async_op=a), finish, opts)

    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        if self._on_cuda(tensors):
            return self._nccl().reduce(tensors, opts)
        op = _op_name(opts.reduceOp)
        root = int(opts.rootRank)
        views = [_view(t) for t in tensors]
        value: Any = views[0] if len(views) == 1 else views
        mine = self._rank == root  # only the root's tensors change (in place there)

        def finish(result: Any) -> list[torch.Tensor]:
            if mine:
                _results_into(views, result)
            return tensors

        return self._work(lambda g, a: g.all_reduce(op, value, async_op=a, in_place=mine), finish, opts)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Any:
        if self._on_cuda(inputs):
            return self._nccl().gather(output_lists, inputs, opts)
        root = int(opts.rootRank)
        views = [_view(t)[None] for t in inputs]

        def finish(result: Any) -> list[list[torch.Tensor]]:
            if self._rank == root:
                for outputs, gathered in zip(output_lists, result):
                    for t, part in zip(outputs, gathered):
                        _copy_into(t, part)
            return output_lists

        return self._work(lambda g, a: g.all_gather(views, 0, async_op=a), finish, opts)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> Any:
        if self._on_cuda(outputs):
            return self._nccl().scatter(outputs, input_lists, opts)
        root = int(opts.rootRank)
        if self._rank == root:
            stacked = [np.stack([_view(t) for t in parts]) for parts in input_lists]
        else:
            stacked = [np.zeros((self._size, *o.shape), dtype=_view(o).dtype) for o in outputs]

        def finish(result: Any) -> list[torch.Tensor]:
            for t, r in zip(outputs, result):
                _copy_into(t, r[self._rank])
            return outputs

        return self._work(lambda g, a: g.broadcast(stacked, root, async_op=a), finish, opts)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],  # noqa: A002
                      input_split_sizes: list[int], opts: Any = None) -> Any:
        if self._on_cuda(input):
            return self._nccl().alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)
        size, rank = self._size, self._rank
        source = _view(input)
        in_splits = list(input_split_sizes) or [source.shape[0] // size] * size
        out_splits = list(output_split_sizes) or [output.shape[0] // size] * size
        if sum(in_splits) != source.shape[0] or sum(out_splits) != output.shape[0]:
            raise ValueError(f"all_to_all_single: split sizes {in_splits} / {out_splits} do not add up to the "
                             f"tensors' first dimensions {source.shape[0]} / {output.shape[0]}")
        bounds = np.cumsum([0, *in_splits])
        chunks = [np.ascontiguousarray(source[bounds[i]:bounds[i + 1]]) for i in range(size)]

        def finish(everyone: Any) -> list[torch.Tensor]:
            _copy_into(output, np.concatenate([everyone[src][rank] for src in range(size)]))
            return [output]

        return self._work(lambda g, a: g.all_gather_objects(chunks, async_op=a), finish, opts)

    all_to_all_single = alltoall_base

    def barrier(self, opts: Any = None) -> Any:
        return self._work(lambda g, a: g.barrier(async_op=a), lambda _: [], opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        if self._on_cuda(tensors):
            return self._nccl().send(tensors, dst, tag)
        views = [np.ascontiguousarray(_view(t)) for t in tensors]
        value: Any = views[0] if len(views) == 1 else views
        return self._work(lambda g, a: g.send(value, dst, tag, async_op=a), lambda _: tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        if self._on_cuda(tensors):
            return self._nccl().recv(tensors, src, tag)
        def finish(result: Any) -> list[torch.Tensor]:
            for t, r in zip(tensors, [result] if len(tensors) == 1 else result):
                if np.asarray(r).nbytes != t.numel() * t.element_size():
                    raise ValueError(f"recv from rank {src} (tag {tag}): got {np.asarray(r).dtype}"
                                     f"{list(np.asarray(r).shape)}, expected {t.dtype}{list(t.shape)}")
                _copy_into(t, r)
            return tensors

        return self._work(lambda g, a: g.recv(src, tag, async_op=a), finish)

    # -- not supported: name what is ---------------------------------------------------

    def _unsupported(self, what: str) -> Any:
        raise NotImplementedError(f"the daskdist torch backend does not support {what}; it supports "
                                  f"{', '.join(SUPPORTED)}")

    def alltoall(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("all_to_all (lists of tensors); use all_to_all_single")

    def recv_anysource(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("recv from any source")

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("monitored_barrier")

    def allgather_coalesced(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("all_gather_coalesced")
