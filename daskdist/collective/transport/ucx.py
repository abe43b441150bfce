"""UCX between replicas (``ucxx``): InfiniBand, RoCE, NVLink, shared memory or TCP, whatever UCX finds.

Optional: needs the ``ucx`` extra (``pip install daskdist[ucx]``, which pulls
``ucxx-cu12``); ``ucxx`` is imported only when this transport is built.

Each replica owns one UCX context and worker with a progress thread (blocking
mode: it sleeps in ``epoll`` between events, so it costs no core). The
worker's address is exchanged at the rendezvous and every replica opens one
endpoint per peer. Messages are UCX tagged messages; a 64-bit UCX tag is
``kind | source rank | sequence``, where the sequence counts the messages of
one ordered pair of replicas:

* a *header* (``framing.HEADER``: daskdist tag, kind, dtype, shape, size),
  followed in the same message by the payload when it has at most
  ``daskdist.collective.ucx.inline-bytes``;
* for larger payloads, the bytes as a second message under the same sequence
  number. The receiver reads the header first, checks it against the output
  array, then posts the receive for the bytes straight into that array
  (``recv_into`` without a reduction: zero copies on the receiver; UCX's
  rendezvous protocol leaves them at the sender until then) or into a scratch
  buffer that is reduced into the output.

Headers are read in sequence order; a header for another tag than the one
asked for is kept (its bytes stay in UCX) until it is asked for. Waits poll
UCX requests with a short spin then back off, checking the replica's mailbox
for aborts and the deadline, so aborts and deadlines behave as on every
other transport. With ``daskdist.collective.ucx.error-handling`` (the
default), endpoints use UCX peer-failure handling: a lost peer fails the
requests on its endpoint and raises ``ReplicaLostError`` (on one host this
limits UCX to TCP, whose sockets report a dead peer; shared memory and CMA do
not support it). The scheduler's group abort wakes every wait either way.

Configuration (``dask.config``, read on the worker when the group starts):
``daskdist.collective.ucx.inline-bytes`` (default 8128),
``daskdist.collective.ucx.error-handling`` (default ``true``),
``daskdist.collective.ucx.progress-mode`` (``blocking``, the default, or
``polling``: a progress thread that spins, lower latency, one core busy).
UCX itself is configured with its ``UCX_*`` environment variables
(``UCX_TLS``, ``UCX_NET_DEVICES`` ...).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from daskdist import config
from daskdist.collective.mailbox import Mailbox, MailboxTimeout, Tag
from daskdist.collective.transport.base import Combine, PayloadMismatch, SendHandle, Transport, apply_payload
from daskdist.collective.transport.framing import (
    ARRAY,
    HEADER,
    decode,
    describe_payload,
    encode,
    pack_header,
    to_dtype,
    unpack_header,
)
from daskdist.exceptions import CollectiveTimeoutError, DaskdistError, ReplicaLostError

if TYPE_CHECKING:
    from types import ModuleType

__all__ = ["UcxTransport", "import_ucxx", "ucx_tag"]

logger = logging.getLogger(__name__)

_HEADER_KIND, _DATA_KIND = 0, 1
_SEQ_BITS = 40
_RANK_BITS = 22
_SEQ_MASK = (1 << _SEQ_BITS) - 1

_SPIN_SECONDS = 20e-6  # poll a request this long before yielding the core
_YIELD_SECONDS = 2e-3  # then yield (sched_yield) this long before sleeping between polls
_SLEEP_SECONDS = 1e-4


def import_ucxx() -> tuple[ModuleType, type]:
    """``ucxx._lib.libucxx`` and ``ucxx._lib.arr.Array``; a clear ``ImportError`` when ucxx is not installed."""
    try:
        import ucxx  # noqa: F401  (loads libucx and sets UCX's environment defaults)
        from ucxx._lib import libucxx
        from ucxx._lib.arr import Array
    except ImportError as e:
        raise ImportError(
            "daskdist.collective.transport is 'ucx', but ucxx cannot be imported on this worker "
            f"({e}). Install the ucx extra (pip install 'daskdist[ucx]', which installs ucxx-cu12) on "
            "every worker, or pick another transport (auto, shm, socket, dask)."
        ) from e
    return libucxx, Array


def ucx_tag(kind: int, src: int, seq: int) -> int:
    """The 64-bit UCX tag of message ``seq`` from ``src`` (``kind``: header 0, data 1)."""
    return (kind << 63) | (src << _SEQ_BITS) | (seq & _SEQ_MASK)


class _Waiter:
    """Polls UCX requests: spin briefly, then yield, then sleep; checks aborts, peer loss and the deadline."""

    __slots__ = ("deadline", "polls", "spin_until", "yield_until")

    def __init__(self, deadline: float):
        now = time.monotonic()
        self.deadline = deadline
        self.spin_until = now + _SPIN_SECONDS
        self.yield_until = now + _YIELD_SECONDS
        self.polls = 0

    def idle(self) -> bool:
        """Wait a little; ``True`` when the caller should run its (costlier) checks now."""
        self.polls += 1
        now = time.monotonic()
        if now < self.spin_until:
            return (self.polls & 63) == 0
        if now < self.yield_until:
            os.sched_yield()
        else:
            time.sleep(_SLEEP_SECONDS)
        return True


class _Send(SendHandle):
    """A UCX send in flight: its requests and the buffers they read from."""

    __slots__ = ("buffers", "dst", "requests", "attempt", "transport")

    def __init__(self, transport: UcxTransport, dst: int, attempt: int, requests: list[Any], buffers: tuple[Any, ...]):
        self.transport = transport
        self.dst = dst
        self.attempt = attempt
        self.requests = requests
        self.buffers = buffers

    @property
    def done(self) -> bool:
        return all(r.completed for r in self.requests)

    def wait(self, deadline: float) -> None:
        try:
            self.transport._wait(self.requests, deadline, self.dst, self.attempt)
        except MailboxTimeout:
            raise CollectiveTimeoutError(
                f"sending to replica {self.dst} over UCX did not complete before the deadline"
            ) from None


class _Header:
    """A received header: what the message holds and, when it was small enough, the bytes themselves."""

    __slots__ = ("dtype", "inline", "kind", "seq", "shape", "tag", "total")

    def __init__(self, seq: int, buffer: np.ndarray):
        tag, kind, dtype, shape, total, _, nbytes = unpack_header(buffer)
        self.seq = seq
        self.tag = tag
        self.kind = kind
        self.dtype = dtype
        self.shape = shape
        self.total = total
        self.inline = buffer[HEADER.size : HEADER.size + total] if nbytes == total else None


class _Inbound:
    """Receive state for one peer: the next header's sequence, its posted receive, headers kept for later."""

    __slots__ = ("buffer", "kept", "next_seq", "request")

    def __init__(self) -> None:
        self.next_seq = 0
        self.request: Any = None
        self.buffer: np.ndarray | None = None
        self.kept: dict[Tag, _Header] = {}


class UcxTransport(Transport):
    """Sends to and receives from peers as UCX tagged messages (``ucxx``).

    Parameters
    ----------
    rank, addresses, mailbox
        As for every ``Transport``.
    group_id
        The replica group (for log messages).
    peers
        The ranks reached through this transport (default: all others).

    Notes
    -----
    ``address`` (this replica's UCX worker address, as text) goes to the
    rendezvous; ``set_peer_addresses`` then opens one endpoint per peer.
    """

    name = "ucx"

    def __init__(self, rank: int, addresses: list[str], mailbox: Mailbox, group_id: str,
                 peers: list[int] | None = None):
        super().__init__(rank, addresses, mailbox)
        if self.size >= 1 << _RANK_BITS:
            raise ValueError(f"the ucx transport supports at most {1 << _RANK_BITS} replicas")
        self._ucx, self._Array = import_ucxx()
        ucx = self._ucx
        self.group_id = group_id
        self.peers = [r for r in range(self.size) if r != rank] if peers is None else list(peers)
        self.inline_bytes = int(config.get("collective.ucx.inline-bytes", 8192 - HEADER.size))
        self.error_handling = _as_bool(config.get("collective.ucx.error-handling", True))
        progress_mode = str(config.get("collective.ucx.progress-mode", "blocking"))
        if progress_mode not in ("blocking", "polling"):
            raise ValueError(f"daskdist.collective.ucx.progress-mode must be blocking or polling, not {progress_mode!r}")
        features = (ucx.Feature.TAG,) if progress_mode == "polling" else (ucx.Feature.TAG, ucx.Feature.WAKEUP)
        self._context = ucx.UCXContext(feature_flags=features)
        self._worker = ucx.UCXWorker(self._context)
        self._worker.start_progress_thread(polling_mode=progress_mode == "polling", epoll_timeout=100)
        #: This replica's UCX worker address (hex), for the rendezvous.
        self.address = self._worker.address.tobytes().hex()
        self._endpoints: dict[int, Any] = {}
        self._lost: dict[int, str] = {}
        self._send_seq = dict.fromkeys(self.peers, 0)
        self._inbound = {peer: _Inbound() for peer in self.peers}
        self._sends: list[_Send] = []  # sends not known to be complete (their buffers must stay alive)
        self._orphans: list[tuple[Any, Any]] = []  # receives abandoned mid-way (timeout, abort): kept until close
        self._scratch: np.ndarray | None = None
        self._closed = False
        self._lock = threading.Lock()
        logger.debug("UCX transport of replica %d (%s): %s", rank, group_id, self._context.config.get("TLS"))

    # -- set-up -------------------------------------------------------------------

    def local_info(self) -> dict[str, Any]:
        return {"ucx": self.address}

    def connect(self, peer_infos: dict[int, dict[str, Any]], membership: Any) -> None:
        self.set_peer_addresses({r: i["ucx"] for r, i in peer_infos.items() if i.get("ucx")})

    def set_peer_addresses(self, addresses: dict[int, str]) -> None:
        """Open an endpoint to every peer (``addresses``: each peer's ``address``, from the rendezvous)."""
        ucx = self._ucx
        for peer in self.peers:
            text = addresses.get(peer)
            if text is None:
                raise ConnectionError(f"no UCX address for replica {peer} (rendezvous did not provide one)")
            address = ucx.UCXAddress.create_from_buffer(bytes.fromhex(text))
            endpoint = ucx.UCXEndpoint.create_from_worker_address(self._worker, address, self.error_handling)
            if self.error_handling:
                endpoint.set_close_callback(self._endpoint_closed, cb_args=(peer,))
            self._endpoints[peer] = endpoint

    def _endpoint_closed(self, peer: int) -> None:
        """UCX closed the endpoint to ``peer`` (peer failure; called from the progress thread)."""
        if not self._closed:
            self._lost.setdefault(peer, "UCX reported the endpoint failed")
            logger.debug("UCX endpoint from replica %d to %d closed", self.rank, peer)

    def _endpoint(self, peer: int) -> Any:
        endpoint = self._endpoints.get(peer)
        if endpoint is None:
            if self._closed:
                raise ReplicaLostError(f"the UCX transport of replica {self.rank} is closed")
            raise ConnectionError(f"no UCX endpoint to replica {peer} (the rendezvous has not run)")
        return endpoint

    # -- waiting ------------------------------------------------------------------

    def _wait(self, requests: list[Any], deadline: float, peer: int, attempt: int) -> None:
        """Wait until ``requests`` complete; raise on abort, peer loss (``ReplicaLostError``) or deadline."""
        if not all(r.completed for r in requests):
            waiter = _Waiter(deadline)
            while not all(r.completed for r in requests):
                if waiter.idle():
                    self._check(peer, attempt)
                    if time.monotonic() > deadline:
                        raise MailboxTimeout()
        for request in requests:
            try:
                request.check_error()
            except Exception as e:  # UCXError and its kinds (canceled, connection reset, unreachable ...)
                self._check(peer, attempt)
                raise ReplicaLostError(
                    f"UCX transfer between replica {self.rank} and replica {peer} ({self.addresses[peer]}) "
                    f"failed: {type(e).__name__}: {e}", worker=self.addresses[peer],
                ) from e

    def _check(self, peer: int, attempt: int) -> None:
        self.mailbox.check(attempt)
        reason = self._lost.get(peer)
        if reason is not None:
            raise ReplicaLostError(f"lost replica {peer} ({self.addresses[peer]}): {reason}",
                                   worker=self.addresses[peer])
        if self._closed:
            raise ReplicaLostError(f"the UCX transport of replica {self.rank} is closed")

    # -- sending ------------------------------------------------------------------

    def send(self, dst: int, tag: Tag, payload: Any) -> SendHandle:
        kind, data = encode(payload)
        dtype, shape = describe_payload(kind, payload)
        raw = data.reshape(-1).view(np.uint8)
        total = raw.nbytes
        inline = total <= self.inline_bytes
        frame = np.empty(HEADER.size + (total if inline else 0), np.uint8)
        pack_header(frame, 0, tag, kind, dtype, shape, total, 0, total if inline else 0)
        if inline and total:
            frame[HEADER.size :] = raw
        endpoint = self._endpoint(dst)
        seq = self._send_seq[dst]
        self._send_seq[dst] = seq + 1
        Array, UCXXTag = self._Array, self._ucx.UCXXTag
        requests = [endpoint.tag_send(Array(frame), UCXXTag(ucx_tag(_HEADER_KIND, self.rank, seq)))]
        if not inline:
            requests.append(endpoint.tag_send(Array(raw), UCXXTag(ucx_tag(_DATA_KIND, self.rank, seq))))
        handle = _Send(self, dst, tag[0], requests, (frame, raw))
        self._sends = [s for s in self._sends if not s.done]
        self._sends.append(handle)
        return handle

    # -- receiving ----------------------------------------------------------------

    def _next_header(self, src: int, deadline: float, attempt: int) -> _Header:
        """The next header from ``src``, in sequence order."""
        inbound = self._inbound[src]
        if inbound.request is None:
            inbound.buffer = np.empty(HEADER.size + self.inline_bytes, np.uint8)
            inbound.request = self._endpoint(src).tag_recv(
                self._Array(inbound.buffer), self._ucx.UCXXTag(ucx_tag(_HEADER_KIND, src, inbound.next_seq))
            )
        self._wait([inbound.request], deadline, src, attempt)  # on timeout the receive stays posted for next time
        if inbound.buffer is None:  # posted with its buffer above, or by an earlier call that timed out
            raise DaskdistError(f"replica {self.rank}: the header receive from replica {src} has no buffer")
        header = _Header(inbound.next_seq, inbound.buffer)
        inbound.request = inbound.buffer = None
        inbound.next_seq += 1
        return header

    def _find(self, src: int, tag: Tag, deadline: float) -> _Header:
        """The header of the message ``src`` sent under ``tag``, keeping the others that come first."""
        inbound = self._inbound[src]
        header = inbound.kept.pop(tag, None)
        if header is not None:
            return header
        while True:
            header = self._next_header(src, deadline, tag[0])
            if header.tag == tag:
                return header
            if header.tag[0] < self.mailbox.current_attempt:  # left over from an aborted attempt
                self._discard(src, header)
            else:
                inbound.kept[header.tag] = header

    def _post_data(self, src: int, header: _Header, buffer: np.ndarray) -> Any:
        return self._endpoint(src).tag_recv(self._Array(buffer),
                                            self._ucx.UCXXTag(ucx_tag(_DATA_KIND, src, header.seq)))

    def _receive_data(self, src: int, header: _Header, buffer: np.ndarray, deadline: float, attempt: int) -> None:
        """Receive the bytes of ``header``'s message into ``buffer`` (a flat uint8 array of ``header.total``)."""
        request = self._post_data(src, header, buffer)
        try:
            self._wait([request], deadline, src, attempt)
        except BaseException:
            self._orphans.append((request, buffer))  # UCX may still write into it: keep it alive
            if buffer is self._scratch:
                self._scratch = None
            raise

    def _discard(self, src: int, header: _Header) -> None:
        """Consume the bytes of a message nobody will read, so that its sender completes."""
        if header.inline is None:
            buffer = np.empty(header.total, np.uint8)
            self._orphans.append((self._post_data(src, header, buffer), buffer))
            self._orphans = [(r, b) for r, b in self._orphans if not r.completed]

    def recv(self, src: int, tag: Tag, deadline: float) -> Any:
        return self._payload(src, self._find(src, tag, deadline), deadline, tag[0])

    def _payload(self, src: int, header: _Header, deadline: float, attempt: int) -> Any:
        """The payload of ``header``'s message (arrays in a buffer of their own)."""
        data = header.inline
        if data is None:
            data = np.empty(header.total, np.uint8)
            self._receive_data(src, header, data, deadline, attempt)
        return decode(header.kind, header.dtype, header.shape, data)

    def recv_into(self, src: int, tag: Tag, deadline: float, out: Any, combine: Combine | None,
                  base: Any = None) -> None:
        header = self._find(src, tag, deadline)
        if header.kind != ARRAY:  # a pickled object (a numpy scalar, ...): apply_payload decides whether it fits
            return apply_payload(self._payload(src, header, deadline, tag[0]), out, combine, base)
        if header.total != out.nbytes or to_dtype(header.dtype) != out.dtype:
            self._discard(src, header)
            raise PayloadMismatch(header.total // max(1, to_dtype(header.dtype).itemsize), out.size)
        if header.inline is not None:
            return apply_payload(decode(header.kind, header.dtype, header.shape, header.inline), out, combine, base)
        if combine is None and isinstance(out, np.ndarray) and out.flags.c_contiguous and out.flags.writeable:
            self._receive_data(src, header, out.reshape(-1).view(np.uint8), deadline, tag[0])  # straight into out
            return None
        scratch = self._scratch_bytes(header.total)
        self._receive_data(src, header, scratch, deadline, tag[0])
        incoming = scratch.view(out.dtype).reshape(out.shape)
        if combine is None:
            np.copyto(out, incoming)
        else:
            combine(out, incoming, base)
        return None

    def _scratch_bytes(self, nbytes: int) -> np.ndarray:
        """A reusable receive buffer of ``nbytes`` (grown as needed)."""
        if self._scratch is None or self._scratch.nbytes < nbytes:
            self._scratch = np.empty(max(nbytes, 1 << 16), np.uint8)
        return self._scratch[:nbytes]

    # -- closing ------------------------------------------------------------------

    def group_aborted(self) -> None:
        """Nothing to release early: the mailbox's group abort already wakes every wait (they poll it)."""

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        worker = self._worker
        try:
            for endpoint in self._endpoints.values():
                if self.error_handling:
                    endpoint.remove_close_callback()
            worker.stop_progress_thread()
            worker.cancel_inflight_requests(period=1_000_000, max_attempts=100)
            for endpoint in self._endpoints.values():
                try:
                    endpoint.close_blocking(period=1_000_000, max_attempts=100)
                except Exception as e:  # noqa: BLE001 - a peer that is gone already
                    logger.debug("Closing a UCX endpoint of replica %d: %s", self.rank, e)
        except Exception:  # closing must not raise; the references are dropped below
            logger.exception("Closing the UCX transport of replica %d failed", self.rank)
        finally:
            for inbound in self._inbound.values():
                inbound.request = inbound.buffer = None
                inbound.kept.clear()
            self._sends.clear()
            self._orphans.clear()
            self._endpoints.clear()
            self._scratch = None


def _as_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() not in ("false", "0", "no", "off", "")
    return bool(value)
