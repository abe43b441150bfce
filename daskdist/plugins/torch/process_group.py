"""``ProcessGroupDaskdist``: a ``torch.distributed.ProcessGroup`` whose collectives are daskdist's.

A Python subclass of ``dist.ProcessGroup`` (torch's ``PyProcessGroup``
trampoline) over one ``daskdist.collective.process_group.ProcessGroup`` (the
replica's root group of its membership generation, or a subgroup of it):
torch's C++ callers (DDP's reducer, ``SyncBatchNorm``, ZeRO) and
``torch.distributed``'s functions reach these methods, which call the group
directly. Tensors travel as numpy views of their memory (no copy for
contiguous CPU tensors; bfloat16 as ``ml_dtypes.bfloat16``); an all-reduce
reduces a contiguous tensor where it lies (``in_place``: no result buffer, no
copy back), other results are copied back in place.

Two paths. A call of torch's Python API with ``async_op=False``
(``opts.asyncOp`` false: torch waits for the work at once) runs in the calling
thread, raises its own error there, and returns one shared completed work
(``_DONE``). Every other call (``async_op=True``, and torch's C++ callers)
returns a ``DaskdistWork`` over a ``collective.Work``: the group's async work
on its FIFO thread (``threaded``), or a work that ran inline. CUDA tensors go
to a torch NCCL process group made through the same store: one table
(``NCCL_FORWARDED``) names the methods forwarded and where their tensors are.

c10d's contract: the group's timeout is the deadline of each of its
collectives (``collective.ProcessGroup.set_timeout``), ``abort`` aborts the
collectives in flight and queued on every member, ``shutdown`` drains the
group's work then refuses more, and ``_get_sequence_number_for_group`` is
the group's own collective number.
"""

from __future__ import annotations

import datetime
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist

from daskdist.collective.work import DONE, Work
from daskdist.ops import ReduceOp

if TYPE_CHECKING:
    from daskdist.collective.process_group import ProcessGroup

__all__ = ["BACKEND_NAME", "NCCL_FORWARDED", "SUPPORTED", "DaskdistWork", "ProcessGroupDaskdist",  # noqa: RUF022
           "torch_future_of"]

logger = logging.getLogger(__name__)

BACKEND_NAME = "daskdist"

#: the operations of ``torch.distributed`` this backend carries (named in the error of any other)
SUPPORTED = ("all_reduce (SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR)", "all_reduce_coalesced", "broadcast",
             "all_gather", "all_gather_into_tensor", "all_gather_coalesced", "reduce_scatter",
             "reduce_scatter_tensor", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "barrier",
             "send", "recv", "new_group")

#: torch reduce op -> daskdist's (the bitwise ops reduce a gathered stack with the numpy ufunc)
_OPS: dict[Any, ReduceOp | np.ufunc] = {
    dist.ReduceOp.RedOpType.SUM: ReduceOp.SUM, dist.ReduceOp.RedOpType.AVG: ReduceOp.MEAN,
    dist.ReduceOp.RedOpType.MIN: ReduceOp.MIN, dist.ReduceOp.RedOpType.MAX: ReduceOp.MAX,
    dist.ReduceOp.RedOpType.PRODUCT: ReduceOp.PRODUCT, dist.ReduceOp.RedOpType.BAND: np.bitwise_and,
    dist.ReduceOp.RedOpType.BOR: np.bitwise_or, dist.ReduceOp.RedOpType.BXOR: np.bitwise_xor,
}
_SUM = dist.ReduceOp.SUM

#: torch dtype -> numpy dtype of its view (same item size)
_NUMPY = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64, torch.int8: np.int8,
          torch.uint8: np.uint8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64,
          torch.bool: np.bool_, torch.uint16: np.uint16, torch.uint32: np.uint32, torch.uint64: np.uint64}
_CARRIED = frozenset(_NUMPY)
_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def _reduce_op(op: Any) -> ReduceOp | np.ufunc:
    """daskdist's op for torch's ``op`` (a ``ReduceOp`` or its ``RedOpType``); an error naming it otherwise."""
    if op == _SUM:  # the common case first
        return ReduceOp.SUM
    try:
        return _OPS[getattr(op, "op", op)]
    except (KeyError, TypeError):
        raise ValueError(f"the daskdist backend does not reduce with ReduceOp.{_op_name(op)}; it reduces with SUM, AVG, "
                         "MIN, MAX, PRODUCT, BAND, BOR and BXOR") from None


def _op_name(op: Any) -> str:
    kind = getattr(op, "op", op)
    return str(getattr(kind, "name", kind))


def _view(tensor: torch.Tensor) -> np.ndarray:
    """The numpy view of a CPU tensor's memory (no copy; strided tensors keep their strides)."""
    if tensor.is_cpu and tensor.dtype in _CARRIED:  # the common case first: a call costs microseconds
        view: np.ndarray = (tensor.detach() if tensor.requires_grad else tensor).numpy()
        return view
    if tensor.device.type != "cpu":
        raise ValueError(f"the daskdist backend carries CPU tensors (CUDA ones go through NCCL, all of one call "
                         f"on one device); got {tensor.device}")
    if tensor.dtype == torch.bfloat16:
        bits: np.ndarray = tensor.detach().view(torch.int16).numpy().view(_BFLOAT16)
        return bits
    raise TypeError(f"the daskdist backend carries float16/bfloat16/float32/float64, integer and bool tensors "
                    f"(complex ones as their real view); got {tensor.dtype}")


def _results_into(views: list[np.ndarray], result: Any) -> None:
    """Copy an all-reduce's results into the tensors' views, except those it reduced where they lie (in place)."""
    for v, r in zip(views, (result,) if len(views) == 1 else result):
        if not np.may_share_memory(v, r):
            np.copyto(v, r, casting="no")  # the same shape and dtype: checked by the collective


def _copy_into(tensor: torch.Tensor, array: Any) -> None:
    np.copyto(_view(tensor), np.asarray(array).reshape(tuple(tensor.shape)), casting="no")


def _sync(opts: Any) -> bool:
    """Whether torch's Python API made this call with ``async_op=False`` (it waits for the work at once).

    Such a call runs here, in the calling thread (after the async work issued
    before it), raises its own error here, and returns ``_DONE``. torch's C++
    callers (DDP's reducer, ``_broadcast_coalesced``) leave ``asyncOp`` at its
    default, ``True``, and get a work of their own.
    """
    return opts is not None and not opts.asyncOp


def _unwrap(done: Any) -> Any:
    """``then`` callback: the collective's value, or its error raised (torch marks the future failed)."""
    ok, value = done.value()
    if not ok:
        raise value
    return value


def torch_future_of(work: Work) -> torch.futures.Future:
    """A ``torch.futures.Future`` completed with ``work``'s result, or failed with its error.

    A failure completes it with an error as torch's C++ callers (DDP's
    reducer) see one (raised in a ``then`` callback), never with the
    exception as its value: ``set_exception`` stores a Python object that the
    reducer reads as the collective's result, without the GIL (a segfault).
    """
    if work.is_success():
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(work.result())
        return done
    source: torch.futures.Future = torch.futures.Future()
    future = source.then(_unwrap)

    def complete(finished: Any) -> None:
        error = finished.exception()
        source.set_result((False, error) if error is not None else (True, finished.result()))

    work.get_future().add_done_callback(complete)
    return future


class DaskdistWork(dist._Work):  # type: ignore[misc]
    """torch's view of a ``collective.Work``: ``wait`` raises the collective's own error, ``abort`` aborts it.

    (torch's ``_create_work_from_future`` makes a work whose ``wait`` swallows
    the future's exception: a failed collective would look done.) torch's C++
    callers see the future (``torch_future_of``) fail with its message.
    """

    def __init__(self, work: Work):
        super().__init__()
        self._work = work
        self._future: torch.futures.Future | None = None

    def wait(self, timeout: Any = None) -> bool:
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout or 0)
        try:
            self._work.wait(seconds if seconds > 0 else None)
        except TimeoutError:
            raise RuntimeError(f"daskdist {self._work.kind} did not finish within {seconds:g} s") from None
        return True

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            self._future = torch_future_of(self._work)
        return self._future

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> Any:
        return self._work.exception()

    def result(self) -> Any:
        return self._work.wait()

    def abort(self) -> None:
        """Abort this collective (and the group's others in flight or queued) on every member."""
        self._work.abort()

    def __repr__(self) -> str:
        return f"<DaskdistWork {self._work!r}>"


_DONE = DaskdistWork(DONE)

#: the methods whose CUDA tensors go to torch's ``ProcessGroupNCCL`` (the same method there), and the
#: position of the argument that holds the tensors (or lists of them)
NCCL_FORWARDED = {
    "allreduce": 0, "allreduce_coalesced": 0, "broadcast": 0, "allgather": 1, "_allgather_base": 1,
    "allgather_into_tensor_coalesced": 1, "allgather_coalesced": 1, "reduce_scatter": 0, "_reduce_scatter_base": 0,
    "reduce_scatter_tensor_coalesced": 1, "reduce": 0, "gather": 1, "scatter": 0, "alltoall_base": 1,
    "alltoall": 1, "send": 0, "recv": 0,
}


def _on_cuda(tensors: Any) -> bool:
    first = tensors
    while isinstance(first, (list, tuple)):
        if not first:
            return False
        first = first[0]
    return isinstance(first, torch.Tensor) and first.is_cuda


def _forwarding_cuda(cls: type) -> type:
    """Wrap each method of ``NCCL_FORWARDED``: CUDA tensors go to the group's NCCL process group."""
    for name, at in NCCL_FORWARDED.items():
        setattr(cls, name, _forwarding(getattr(cls, name), name, at))
    return cls


def _forwarding(cpu: Callable[..., Any], name: str, at: int) -> Callable[..., Any]:
    @functools.wraps(cpu)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) > at and _on_cuda(args[at]):
            return getattr(self._nccl(), name)(*args, **kwargs)
        return cpu(self, *args, **kwargs)

    return method


@_forwarding_cuda
class ProcessGroupDaskdist(dist.ProcessGroup):  # type: ignore[misc]
    """torch's process group over a daskdist ``collective.ProcessGroup`` (a generation's root group or a subgroup).

    Parameters
    ----------
    group
        The daskdist process group: its rank and size are this group's.
    threaded
        Run async work on the group's FIFO thread (``True``) or in the caller (``False``).
    store
        The group's torch ``Store`` (``DaskdistStore``): NCCL's rendezvous for CUDA tensors.
    """

    def __init__(self, group: ProcessGroup, threaded: bool, store: Any = None):
        super().__init__(group.rank, group.size)
        self._group = group
        self._threaded = threaded
        self._rank = group.rank
        self._size = group.size
        self._group_name = ""
        self._group_desc = ""
        self._store = store
        self._nccl_group: Any = None
        self._closed: str | None = None  # why this torch group refuses work (shut down, aborted), once it does

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

    @property
    def daskdist_group(self) -> Any:
        """The daskdist ``collective.ProcessGroup`` this torch group calls."""
        return self._group

    def __repr__(self) -> str:
        return f"<ProcessGroupDaskdist rank={self._rank} size={self._size} name={self._group_name!r}>"

    # -- c10d's contract: timeout, sequence numbers, abort, shutdown ----------------------

    @property
    def options(self) -> Any:
        """torch's view of the group's options: its timeout."""
        options = dist.ProcessGroup.Options(BACKEND_NAME)
        options._timeout = datetime.timedelta(seconds=self._group.timeout)
        return options

    def _get_sequence_number_for_group(self) -> int:
        """The group's own number of its last collective (in the current attempt): what desync reports compare."""
        return self._group.sequence_number

    def _set_sequence_number_for_group(self) -> None:
        """Nothing to agree on: the group numbers its collectives alike on every member."""

    def abort(self) -> None:
        """Abort the group's collectives in flight and queued, on every member (they raise); refuse more here."""
        if self._closed is None:
            self._closed = f"the daskdist torch process group {self._group_name or self._group.name} was aborted"
            logger.info("Replica %d aborts torch process group %s", self._rank, self._group.name)
            self._group.abort(RuntimeError(f"{self._closed} by its member {self._rank}"))

    def shutdown(self) -> None:
        """Wait for the group's work issued so far (its errors stay in its works), then refuse more."""
        if self._closed is None:
            self._group.fence()
            self._closed = f"the daskdist torch process group {self._group_name or self._group.name} was shut down"

    def _check_open(self) -> Any:
        if self._closed is not None:
            raise RuntimeError(self._closed)
        self._group.check_open()
        return self._group

    # -- CUDA tensors: torch's NCCL through the same store ---------------------------------

    def _nccl(self) -> Any:
        """torch's ``ProcessGroupNCCL`` for this group, made on first use through the group's store (no port)."""
        if self._nccl_group is None:
            if self._store is None or not hasattr(dist, "ProcessGroupNCCL"):
                raise ValueError("CUDA tensors need torch's NCCL backend (a CUDA build of torch) and a group made "
                                 "by dd.plugins.torch.init_process_group()")
            store = dist.PrefixStore(f"nccl/{self._group_name}/", self._store)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = datetime.timedelta(seconds=self._group.timeout)
            self._nccl_group = dist.ProcessGroupNCCL(store, self._rank, self._size, options)
        return self._nccl_group

    # -- machinery ----------------------------------------------------------------

    def _run(self, kind: str, call: Callable[[Any, bool], Any], finish: Callable[[Any], Any], opts: Any = None) -> Any:
        """Run ``call`` (``(group, async_op) -> result or Work``) and ``finish`` on its result.

        At once, raising here, when torch's Python API waits for it
        (``_sync``); else as a ``DaskdistWork``: on the group's FIFO thread
        (``threaded``) or inline, failing the work (not raising) on error.
        """
        if _sync(opts):
            finish(call(self._check_open(), False))
            return _DONE
        try:
            group = self._check_open()
            if self._threaded:
                return DaskdistWork(call(group, True).then(finish))
            result = finish(call(group, False))
        except BaseException as e:  # noqa: BLE001 - the torch call waiting on the work raises it
            logger.debug("daskdist torch %s failed: %s", kind, e)
            return DaskdistWork(Work.failed(e, kind))
        return DaskdistWork(Work.completed(result, kind))

    # -- collectives ----------------------------------------------------------------

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        """All-reduce in place: a contiguous tensor is reduced where it lies (no result buffer, no copy back)."""
        if opts is not None and not opts.asyncOp and len(tensors) == 1 and self._closed is None:  # the latency path
            tensor = tensors[0]
            if tensor.is_cpu and tensor.dtype in _CARRIED and not tensor.requires_grad:
                op = _reduce_op(opts.reduceOp)
                if type(op) is ReduceOp:
                    view = tensor.numpy()
                    result = self._group.inline_all_reduce(op, view, None, True)
                    if not np.may_share_memory(view, result):
                        np.copyto(view, result, casting="no")
                    return _DONE
        op = _reduce_op(opts.reduceOp if opts is not None else _SUM)
        views = [_view(t) for t in tensors]
        if not isinstance(op, ReduceOp):  # a bitwise op: reduce the gathered stack here
            ufunc = op
            stacked = [v[None] for v in views]

            def finish_bitwise(gathered: Any) -> list[torch.Tensor]:
                for v, g in zip(views, gathered):
                    np.copyto(v, ufunc.reduce(g, axis=0), casting="no")
                return tensors

            return self._run("all_reduce", lambda g, a: g.all_gather(stacked, 0, async_op=a), finish_bitwise, opts)
        value: Any = views[0] if len(views) == 1 else views

        def finish(result: Any) -> list[torch.Tensor]:
            _results_into(views, result)
            return tensors

        return self._run("all_reduce", lambda g, a: g.all_reduce(op, value, async_op=a, in_place=True), finish, opts)

    allreduce_coalesced = allreduce

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        views = [_view(t) for t in tensors]
        root = int(opts.rootRank)

        def finish(result: Any) -> list[torch.Tensor]:
            if self._rank != root:
                for t, r in zip(tensors, result):
                    _copy_into(t, r)
            return tensors

        return self._run("broadcast", lambda g, a: g.broadcast(views, root, async_op=a), finish, opts)

    def allgather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        views = [_view(t)[None] for t in inputs]

        def finish(result: Any) -> list[list[torch.Tensor]]:
            for outputs, gathered in zip(output_lists, result):
                for t, part in zip(outputs, gathered):
                    _copy_into(t, part)
            return output_lists

        return self._run("all_gather", lambda g, a: g.all_gather(views, 0, async_op=a), finish, opts)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> Any:
        return self.allgather(output_lists, inputs, opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:  # noqa: A002
        return self.allgather_into_tensor_coalesced([output], [input], opts)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        views = [_view(t).reshape((1, -1)) for t in inputs]

        def finish(result: Any) -> list[torch.Tensor]:
            for t, r in zip(outputs, result):
                _copy_into(t, r)
            return outputs

        return self._run("all_gather", lambda g, a: g.all_gather(views, 0, async_op=a), finish, opts)

    def reduce_scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> Any:
        op = self._arithmetic(opts.reduceOp, "reduce_scatter")
        stacked = [np.stack([_view(t) for t in parts]) for parts in input_lists]

        def finish(result: Any) -> list[torch.Tensor]:
            for t, r in zip(outputs, result):
                _copy_into(t, r)
            return outputs

        return self._run("reduce_scatter", lambda g, a: g.reduce_scatter(op, stacked, 0, async_op=a), finish, opts)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> Any:  # noqa: A002
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any) -> Any:
        op = self._arithmetic(opts.reduceOp, "reduce_scatter_tensor")
        for o, i in zip(outputs, inputs):
            if i.numel() != o.numel() * self._size:
                raise ValueError(f"reduce_scatter_tensor needs an input of world size x the output's elements: "
                                 f"input {list(i.shape)}, output {list(o.shape)}, world size {self._size}")
        views = [_view(t).reshape((self._size, -1)) for t in inputs]

        def finish(result: Any) -> list[torch.Tensor]:
            for t, r in zip(outputs, result):
                _copy_into(t, r)
            return outputs

        return self._run("reduce_scatter", lambda g, a: g.reduce_scatter(op, views, 0, async_op=a), finish, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        op = self._arithmetic(opts.reduceOp, "reduce")
        root = int(opts.rootRank)
        views = [_view(t) for t in tensors]
        value: Any = views[0] if len(views) == 1 else views
        mine = self._rank == root  # only the root's tensors change (in place there)

        def finish(result: Any) -> list[torch.Tensor]:
            if mine:
                _results_into(views, result)
            return tensors

        return self._run("reduce", lambda g, a: g.all_reduce(op, value, async_op=a, in_place=mine), finish, opts)

    def gather(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Any:
        root = int(opts.rootRank)
        views = [_view(t)[None] for t in inputs]

        def finish(result: Any) -> list[list[torch.Tensor]]:
            if self._rank == root:
                for outputs, gathered in zip(output_lists, result):
                    for t, part in zip(outputs, gathered):
                        _copy_into(t, part)
            return output_lists

        return self._run("gather", lambda g, a: g.all_gather(views, 0, async_op=a), finish, opts)

    def scatter(self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any) -> Any:
        root = int(opts.rootRank)
        if self._rank == root:
            stacked = [np.stack([_view(t) for t in parts]) for parts in input_lists]
        else:
            stacked = [np.zeros((self._size, *o.shape), dtype=_view(o).dtype) for o in outputs]

        def finish(result: Any) -> list[torch.Tensor]:
            for t, r in zip(outputs, result):
                _copy_into(t, r[self._rank])
            return outputs

        return self._run("scatter", lambda g, a: g.broadcast(stacked, root, async_op=a), finish, opts)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],  # noqa: A002
                      input_split_sizes: list[int], opts: Any = None) -> Any:
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

        return self._run("all_to_all_single", lambda g, a: g.all_gather_objects(chunks, async_op=a), finish, opts)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        """``all_to_all`` of lists: this member's ``inputs[j]`` lands in member j's ``outputs[rank]``."""
        if len(inputs) != self._size or len(outputs) != self._size:
            raise ValueError(f"all_to_all needs world size ({self._size}) input and output tensors; got "
                             f"{len(inputs)} and {len(outputs)}")
        chunks = [np.ascontiguousarray(_view(t)) for t in inputs]
        rank = self._rank

        def finish(everyone: Any) -> list[torch.Tensor]:
            for src, t in enumerate(outputs):
                part = everyone[src][rank]
                if part.shape != tuple(t.shape) or part.dtype != _view(t).dtype:
                    raise ValueError(f"all_to_all: member {src} sent {part.dtype}{list(part.shape)} to member "
                                     f"{rank}, whose output {src} is {t.dtype}{list(t.shape)}")
                _copy_into(t, part)
            return outputs

        return self._run("all_to_all", lambda g, a: g.all_gather_objects(chunks, async_op=a), finish, opts)

    def barrier(self, opts: Any = None) -> Any:
        return self._run("barrier", lambda g, a: g.barrier(async_op=a), lambda _: [], opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> Any:
        views = [np.ascontiguousarray(_view(t)) for t in tensors]
        value: Any = views[0] if len(views) == 1 else views
        return self._run("send", lambda g, a: g.send(value, dst, tag, async_op=a), lambda _: tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> Any:
        def finish(result: Any) -> list[torch.Tensor]:
            for t, r in zip(tensors, [result] if len(tensors) == 1 else result):
                if np.asarray(r).nbytes != t.numel() * t.element_size():
                    raise ValueError(f"recv from rank {src} (tag {tag}): got {np.asarray(r).dtype}"
                                     f"{list(np.asarray(r).shape)}, expected {t.dtype}{list(t.shape)}")
                _copy_into(t, r)
            return tensors

        return self._run("recv", lambda g, a: g.recv(src, tag, async_op=a), finish)

    # -- helpers and what is not supported ----------------------------------------------

    def _arithmetic(self, torch_op: Any, what: str) -> ReduceOp:
        op = _reduce_op(torch_op)
        if type(op) is not ReduceOp:
            raise ValueError(f"the daskdist backend's {what} reduces with SUM, AVG, MIN, MAX or PRODUCT; the "
                             f"bitwise ops (BAND, BOR, BXOR) are all_reduce's only; got ReduceOp.{_op_name(torch_op)}")
        return op

    def _unsupported(self, what: str) -> Any:
        raise NotImplementedError(f"the daskdist torch backend does not support {what}; it supports "
                                  f"{', '.join(SUPPORTED)}")

    def recv_anysource(self, *args: Any, **kwargs: Any) -> Any:
        return self._unsupported("recv from any source (give recv a src)")


# the names torch's coalescing manager and functional collectives call
ProcessGroupDaskdist.all_gather_single = ProcessGroupDaskdist._allgather_base
ProcessGroupDaskdist.all_gather_single_coalesced = ProcessGroupDaskdist.allgather_into_tensor_coalesced
ProcessGroupDaskdist.reduce_scatter_single = ProcessGroupDaskdist._reduce_scatter_base
ProcessGroupDaskdist.reduce_scatter_single_coalesced = ProcessGroupDaskdist.reduce_scatter_tensor_coalesced
ProcessGroupDaskdist.all_to_all_single = ProcessGroupDaskdist.alltoall_base
