"""The one TCP framing of daskdist: listen/connect, hello with a secret, TLS, heartbeats, framed messages.

Three protocols run on it: the client's command channel to its replicas
(``daskdist.group.channel`` / ``daskdist.replica.command_server``), the socket
transport between replicas (``daskdist.collective.transport.socket``) and the
parameter-store channel (``daskdist.ps.channel``). Each names its protocol in the
hello and presents its secret; what they send after the hello is theirs.

Modules, one job each:

``frames``
    whole reads and scatter/gather writes on a blocking socket (``sendmsg``,
    ``recv_into``), the end-of-stream error.
``messages``
    one object per frame: pickle protocol 5 with numpy and ``PickleBuffer``
    buffers out of band, written with the header in one ``sendmsg``.
``hello``
    the greeting: protocol name, the secret (compared in constant time) and a
    fixed-size tail of the protocol's own (a rank, a generation).
``heartbeat``
    TCP keepalive and ``TCP_USER_TIMEOUT``: a peer gone silent fails the connection.
``tls``
    the cluster's ``distributed.Security`` contexts on ``tls://`` clusters.
``connection``
    ``listen``, ``connect`` and ``accept`` (hello, TLS and heartbeat in one
    place) and ``Acceptor``, an accept loop on a thread.

Nothing here imports the rest of daskdist: every layer may use it.
"""

from daskdist.wire.connection import Acceptor, accept, connect, listen
from daskdist.wire.frames import PeerClosed, recv_exactly, recv_into, send_parts
from daskdist.wire.hello import WireRejected
from daskdist.wire.messages import recv_message, send_message

__all__ = ["Acceptor", "PeerClosed", "WireRejected", "accept", "connect", "listen", "recv_exactly", "recv_into",
           "recv_message", "send_message", "send_parts"]
