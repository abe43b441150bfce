"""How a payload is described on the wire (shared by the shared-memory and socket transports).

A payload is an array (sent as its raw bytes), text (UTF-8) or any other
object (pickled). A fixed binary header says which, with the tag, the
sizes and, for arrays, the dtype and shape.
"""

from __future__ import annotations

import pickle
import struct
from typing import Any

import numpy as np

from daskdist.collective.mailbox import Tag

__all__ = ["ARRAY", "HEADER", "MAX_NDIM", "OBJECT", "TEXT", "SignedArrayFrames", "decode", "describe_payload",
           "dtype_text", "encode", "pack_header", "to_dtype", "unpack_header"]

ARRAY, OBJECT, TEXT = 0, 1, 2
MAX_NDIM = 8

#: attempt, seq, src, name, kind, total bytes, offset, piece bytes, ndim, shape[8], dtype
HEADER = struct.Struct("<qqq40sbqqqb8q24s")
_NUMBERS = struct.Struct("<qq")  # a header's first two fields: the tag's attempt and collective number


def encode(payload: Any) -> tuple[int, np.ndarray]:
    """The kind of ``payload`` and its bytes (arrays as they are, text as UTF-8, anything else pickled)."""
    if isinstance(payload, np.ndarray) and payload.dtype.kind != "O" and payload.ndim <= MAX_NDIM:
        return ARRAY, np.ascontiguousarray(payload)
    if isinstance(payload, str):
        return TEXT, np.frombuffer(payload.encode(), np.uint8)
    return OBJECT, np.frombuffer(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)


def describe_payload(kind: int, payload: Any) -> tuple[str, tuple[int, ...]]:
    """dtype text and shape for the header (a dtype name where ``str`` would be ambiguous, e.g. bfloat16)."""
    if kind != ARRAY:
        return "", ()
    dtype = payload.dtype
    return (dtype.name if dtype.kind == "V" else dtype.str), payload.shape


def dtype_text(dtype: np.dtype[Any]) -> str:
    text: str = dtype.name if dtype.kind == "V" else dtype.str  # numpy's stubs type ``name`` loosely
    return text


def pack_header(buffer: Any, offset: int, tag: Tag, kind: int, dtype: str, shape: tuple[int, ...], total: int,
                piece_offset: int, nbytes: int) -> None:
    dims = tuple(shape) + (0,) * (MAX_NDIM - len(shape))
    HEADER.pack_into(buffer, offset, tag[0], tag[1], tag[2], tag[3].encode(), kind, total, piece_offset, nbytes,
                     len(shape), *dims, dtype.encode())


def unpack_header(buffer: Any, offset: int = 0) -> tuple[Tag, int, str, tuple[int, ...], int, int, int]:
    """``(tag, kind, dtype, shape, total, offset, nbytes)``."""
    fields = HEADER.unpack_from(buffer, offset)
    attempt, seq, src, name, kind, total, piece_offset, nbytes, ndim = fields[:9]
    shape = fields[9 : 9 + ndim]
    dtype = fields[17].rstrip(b"\0").decode()
    return (attempt, seq, src, name.rstrip(b"\0").decode()), kind, dtype, shape, total, piece_offset, nbytes


def to_dtype(text: str) -> np.dtype[Any]:
    """The dtype written by ``dtype_text`` (``ml_dtypes`` names such as bfloat16 included)."""
    try:
        return np.dtype(text)
    except TypeError:
        import ml_dtypes

        scalar_type: type[Any] = getattr(ml_dtypes, text)  # e.g. ml_dtypes.bfloat16
        return np.dtype(scalar_type)


def decode(kind: int, dtype: str, shape: Any, data: Any) -> Any:
    """Rebuild a payload from its bytes (arrays are views of ``data``)."""
    if kind == ARRAY:
        return np.frombuffer(data, dtype=to_dtype(dtype)).reshape(shape)
    if kind == TEXT:
        return bytes(data).decode()
    return pickle.loads(data)


class SignedArrayFrames:
    """A collective's signature frame and one array's frame to one peer, packed once and renumbered per send.

    ``prefix`` holds the signature's header, the signature and the array's
    header; a send sets the attempt and collective number of both headers
    (``renumber``, under the connection's write lock) and writes ``prefix``
    then the array's bytes. On the wire these are the two frames a general
    collective sends (``tags`` and payloads as ``encode`` would make them).

    Parameters
    ----------
    sig_tag, sig
        The signature message's tag and text (a ``TEXT`` frame).
    data_tag, dtype, shape
        The array message's tag, ``dtype_text`` and shape.
    """

    __slots__ = ("_second", "data_tag", "nbytes", "prefix", "sig", "sig_tag")

    def __init__(self, sig_tag: Tag, sig: str, data_tag: Tag, dtype: np.dtype[Any], shape: tuple[int, ...]) -> None:
        text = sig.encode()
        self.sig_tag, self.sig, self.data_tag = sig_tag, sig, data_tag
        self.nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        self._second = HEADER.size + len(text)
        self.prefix = bytearray(self._second + HEADER.size)
        pack_header(self.prefix, 0, sig_tag, TEXT, "", (), len(text), 0, len(text))
        self.prefix[HEADER.size : self._second] = text
        pack_header(self.prefix, self._second, data_tag, ARRAY, dtype_text(dtype), shape, self.nbytes, 0, self.nbytes)

    def renumber(self, attempt: int, seq: int) -> None:
        """Both frames' tags become ``(attempt, seq, ...)``."""
        _NUMBERS.pack_into(self.prefix, 0, attempt, seq)
        _NUMBERS.pack_into(self.prefix, self._second, attempt, seq)
