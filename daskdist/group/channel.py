"""The client's end of the direct command channel: one blocking socket to each replica.

``ReplicaGroup.call`` sends a command to every replica it targets and waits
for their answers on these sockets from the calling thread, so a command
costs one send and one receive per replica: no hop through the client's
event loop, no Dask RPC and no hop through the worker's event loop (see
``daskdist.replica.command_server``). Answers carry their run id: an answer
left unread by an earlier call (a replica that was still busy when the call
gave up on it) is skipped, never taken for a later one.
"""

from __future__ import annotations

import logging
import pickle
import select
import socket
import ssl
import struct
import time
from typing import Any

from daskdist import serialization, wire
from daskdist.exceptions import ReplicaLostError
from daskdist.wire.tls import client_context as client_ssl_context

__all__ = ["PROTOCOL", "REQUEST", "WAIT_ENDING_KINDS", "CommandChannels", "client_ssl_context", "send_request"]

#: The command channel's name in the wire hello (``daskdist.wire.hello``).
PROTOCOL = "daskdist-command-2"
#: A command's header: run id, generation, settings bytes, payload bytes (answers are ``daskdist.wire`` messages).
REQUEST = struct.Struct("<qqQQ")

logger = logging.getLogger(__name__)

#: Failure kinds after which the client stops waiting for the other replicas' answers: a lost member, and a
#: group that moved to a newer generation (re-formed without members that may never answer).
WAIT_ENDING_KINDS = ("lost", "stale")


class CommandChannels:
    """Connections from the client to the replicas' command servers, keyed by worker address.

    Parameters
    ----------
    secret
        The group's secret (``GroupSpec.secret``), presented after connecting.
    ssl_context
        The client's TLS context on ``tls://`` clusters, else ``None``.
    """

    def __init__(self, secret: str, ssl_context: ssl.SSLContext | None = None):
        self._secret = secret
        self._ssl_context = ssl_context
        self._sockets: dict[str, socket.socket] = {}

    def connect(self, address: str, endpoint: tuple[str, int], timeout: float = 10) -> None:
        """Open the channel to the replica on worker ``address`` (listening at ``endpoint``)."""
        self._sockets[address] = wire.connect(endpoint, PROTOCOL, self._secret, ssl_context=self._ssl_context,
                                              timeout=timeout)

    def has(self, addresses: list[str]) -> bool:
        """Whether every one of ``addresses`` has an open channel."""
        return all(a in self._sockets for a in addresses)

    def call(self, targets: dict[int, str], run_id: int, generation: int, settings: dict[str, Any] | None,
             payloads: dict[int, bytes], abort_grace: float) -> dict[int, dict[str, Any] | None]:
        """Send ``payloads[rank]`` to each target and gather the answers, by rank.

        After the first failure the others get ``abort_grace`` seconds to
        report theirs; a lost replica, or one that says the group moved to a
        newer generation (the scheduler re-formed it without some members, who
        may never answer: a host cut off), ends the wait at once. Ranks that
        never answered map to ``None``.
        """
        settings_bytes = pickle.dumps(settings, protocol=pickle.HIGHEST_PROTOCOL) if settings is not None else b""
        responses: dict[int, dict[str, Any] | None] = dict.fromkeys(targets)
        pending: dict[int, int] = {}  # fd -> rank
        failed = lost = False
        for rank, address in targets.items():
            sock = self._sockets.get(address)
            try:
                if sock is None:
                    raise ConnectionError("no command channel")
                send_request(sock, run_id, generation, settings_bytes, payloads[rank])
            except (OSError, ConnectionError, ssl.SSLError) as e:
                responses[rank] = self._lost(rank, address, e)
                failed = lost = True
                continue
            pending[sock.fileno()] = rank
        poller = select.poll()
        for fd in pending:
            poller.register(fd, select.POLLIN)
        deadline: float | None = None
        while pending and not lost:
            if deadline is None:
                timeout = 500
            else:
                timeout = max(0, int((deadline - time.monotonic()) * 1000))
                if timeout == 0:
                    break
            for fd, _ in poller.poll(timeout):
                rank = pending.pop(fd)
                poller.unregister(fd)
                address = targets[rank]
                try:
                    response = self._read(address, run_id)
                except (OSError, ConnectionError, ssl.SSLError, EOFError, pickle.UnpicklingError) as e:
                    response = self._lost(rank, address, e)
                responses[rank] = response
                if response.get("status") != "OK":
                    failed = True
                    lost |= response.get("kind") in WAIT_ENDING_KINDS
            if failed and deadline is None:
                deadline = time.monotonic() + abort_grace
        return responses

    def _read(self, address: str, run_id: int) -> dict[str, Any]:
        """The answer to ``run_id`` on ``address``'s channel, skipping answers to earlier calls."""
        sock = self._sockets[address]
        while True:
            response: dict[str, Any] = wire.recv_message(sock)
            if response.get("run_id", run_id) == run_id:
                return response

    def _lost(self, rank: int, address: str, error: BaseException) -> dict[str, Any]:
        sock = self._sockets.pop(address, None)
        if sock is not None:
            sock.close()
        lost = ReplicaLostError(
            f"replica {rank} was lost: the command channel to its worker {address} failed ({error!r})", worker=address
        )
        return serialization.error_message(lost, rank, address)

    def close(self) -> None:
        for sock in self._sockets.values():
            try:
                sock.close()
            except OSError:
                pass
        self._sockets.clear()


def send_request(sock: socket.socket, run_id: int, generation: int, settings: bytes, payload: bytes) -> None:
    """Send one command: a fixed header (``REQUEST``), the pickled new settings (empty when unchanged) and
    the pickled command, in one ``sendmsg`` (``daskdist.wire.frames``)."""
    wire.send_parts(sock, [REQUEST.pack(run_id, generation, len(settings), len(payload)), settings, payload])
