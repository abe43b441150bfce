"""Per-pair transport choice: each peer is reached through the transport that suits the pair."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from daskdist.collective.mailbox import Mailbox, Tag
from daskdist.collective.transport.base import Combine, SendHandle, Transport

__all__ = ["RoutedTransport"]


class RoutedTransport(Transport):
    """Sends to and receives from each peer through ``routes[peer]``.

    Parameters
    ----------
    routes
        The transport for each other rank (shared-memory for same-host
        peers, Dask comms for the others, ...).
    """

    name = "routed"

    def __init__(self, rank: int, addresses: list[str], mailbox: Mailbox, routes: dict[int, Transport]):
        super().__init__(rank, addresses, mailbox)
        self.routes = routes
        #: Bytes of arrays sent, by ``(route name, peer)``: which transport carried what (the latency lane
        #: and single-copy reads, used only when every peer shares the host, are not counted).
        self.sent_bytes: Counter[tuple[str, int]] = Counter()

    def send(self, dst: int, tag: Tag, payload: Any) -> SendHandle:
        route = self.routes[dst]
        self.sent_bytes[route.name, dst] += getattr(payload, "nbytes", 0)
        return route.send(dst, tag, payload)

    def send_many(self, dst: int, messages: Sequence[tuple[Tag, Any]]) -> list[SendHandle]:
        route = self.routes[dst]
        self.sent_bytes[route.name, dst] += sum(getattr(payload, "nbytes", 0) for _, payload in messages)
        return route.send_many(dst, messages)

    def recv(self, src: int, tag: Tag, deadline: float) -> Any:
        return self.routes[src].recv(src, tag, deadline)

    def recv_into(self, src: int, tag: Tag, deadline: float, out: Any, combine: Combine | None,
                  base: Any = None) -> None:
        return self.routes[src].recv_into(src, tag, deadline, out, combine, base)

    def sendrecv(self, dst: int, send_tag: Tag, payload: Any, src: int, recv_tag: Tag, deadline: float, out: Any,
                 combine: Combine | None, base: Any = None) -> None:
        route = self.routes[src]
        self.sent_bytes[self.routes[dst].name, dst] += getattr(payload, "nbytes", 0)
        if self.routes[dst] is route:
            return route.sendrecv(dst, send_tag, payload, src, recv_tag, deadline, out, combine, base)
        handle = self.routes[dst].send(dst, send_tag, payload)  # not self.send: counted once, above
        self.recv_into(src, recv_tag, deadline, out, combine, base)
        handle.wait(deadline)
        return None

    def routes_by_peer(self) -> dict[int, Transport]:
        return dict(self.routes)

    def describe(self) -> dict[int, str]:
        """The transport name used for each peer."""
        return {peer: transport.name for peer, transport in self.routes.items()}

    def local_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {}
        for transport in {id(t): t for t in self.routes.values()}.values():
            info.update(transport.local_info())
        return info

    def connect(self, peer_infos: dict[int, dict[str, Any]], membership: Any) -> None:
        for transport in {id(t): t for t in self.routes.values()}.values():
            transport.connect(peer_infos, membership)

    def group_aborted(self) -> None:
        for transport in {id(t): t for t in self.routes.values()}.values():
            transport.group_aborted()

    def close(self) -> None:
        for transport in {id(t): t for t in self.routes.values()}.values():
            transport.close()
