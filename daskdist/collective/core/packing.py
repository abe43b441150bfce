"""Flatten nested structures of arrays into a few flat buffers ("packs") and back.

Every leaf of a structure (dict, list, tuple, namedtuple: ``optree``) is
converted to an array; leaves of one dtype (and one device kind) are fused
into packs of about ``bytes_per_pack`` bytes, each a single contiguous 1-D
buffer, so a list of many small gradients costs one collective per pack
instead of one per tensor. This is the only copy a collective makes of the
caller's data; results are views into the reduced packs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import optree

from daskdist.arrays import as_array, describe, namespace

__all__ = ["Pack", "PackedStructure", "flatten", "pack"]


def flatten(value: Any) -> tuple[list[Any], Any, list[Callable[[Any], Any]]]:
    """Flatten ``value`` into array leaves, its tree spec, and per-leaf converters back.

    ``None`` is an empty subtree (as in ``tf.nest``). Variables are read.
    """
    leaves, treedef = optree.tree_flatten(value, none_is_leaf=False)
    arrays, restore = [], []
    for leaf in leaves:
        read = getattr(leaf, "read_value", None)
        if read is not None and not hasattr(leaf, "__dlpack__") and callable(read):
            leaf = read()
        array, back = as_array(leaf)
        arrays.append(array)
        restore.append(back)
    return arrays, treedef, restore


_SIGNATURES: dict[tuple[Any, ...], str] = {}
_SIGNATURES_KEPT = 4096


def signature(kind: str, detail: str, leaves: list[Any], treedef: Any) -> str:
    """A string that must be identical on every replica joining the same collective.

    Cached by structure, shapes and dtypes: a training step repeats the same
    collectives, and formatting is the costly part.
    """
    key = (kind, detail, treedef, *((leaf.shape, leaf.dtype, type(leaf)) for leaf in leaves))
    sig = _SIGNATURES.get(key)
    if sig is None:
        shapes = ", ".join(describe(leaf) for leaf in leaves)
        sig = f"{kind} {detail} | structure {treedef} | leaves [{shapes}]"
        if len(_SIGNATURES) >= _SIGNATURES_KEPT:
            _SIGNATURES.clear()
        _SIGNATURES[key] = sig
    return sig


@dataclass
class Pack:
    """One flat buffer holding the leaves ``indices`` of a structure."""

    indices: list[int]
    buffer: Any
    borrowed: bool = False  # ``buffer`` is the caller's own memory (one leaf, no copy): read it, never write it


@dataclass
class PackedStructure:
    """A structure whose leaves were fused into packs; ``unpack`` rebuilds it from the packs."""

    treedef: Any
    shapes: list[tuple[int, ...]]
    restore: list[Callable[[Any], Any]]
    packs: list[Pack]

    @property
    def nbytes(self) -> int:
        return sum(p.buffer.nbytes for p in self.packs)

    def unpack(self) -> Any:
        leaves: list[Any] = [None] * len(self.shapes)
        for p in self.packs:
            offset = 0
            for index in p.indices:
                shape = self.shapes[index]
                size = 1
                for d in shape:
                    size *= d
                leaves[index] = self.restore[index](p.buffer[offset : offset + size].reshape(shape))
                offset += size
        return optree.tree_unflatten(self.treedef, leaves)


def pack(leaves: list[Any], treedef: Any, restore: list[Any], bytes_per_pack: int = 0, num_packs: int = 1,
         borrow: bool = False, allocate: Callable[[int, Any], Any] | None = None,
         in_place: bool = False) -> PackedStructure:
    """Copy ``leaves`` into packs grouped by dtype and device.

    Parameters
    ----------
    bytes_per_pack
        Upper bound (a hint, as in TF) on each pack's size; ``0``: no bound.
    num_packs
        Split each dtype group into this many packs of about equal size
        (``NcclAllReduce(num_packs=...)``); ``0`` puts every leaf in its own
        pack; ignored when ``bytes_per_pack`` is set.
    borrow
        A pack of one contiguous leaf is a flat view of the caller's array
        (``Pack.borrowed``) instead of a copy; the collective must then write
        its result elsewhere.
    in_place
        With ``borrow``: the caller lets the collective write its result
        into that array (an in-place all-reduce), so the pack is not marked
        borrowed and the engines reduce into the caller's memory.
    allocate
        ``allocate(size, dtype)`` gives the flat numpy buffer of a pack of
        several leaves (a ``BufferPool``); default: a new array.
    """
    groups: dict[tuple[str, str], list[int]] = {}
    for i, leaf in enumerate(leaves):
        key = (namespace(leaf).__name__, leaf.dtype.str)
        groups.setdefault(key, []).append(i)

    packs = []
    for indices in groups.values():
        total = sum(leaves[i].nbytes for i in indices)
        limit = bytes_per_pack
        if not limit and num_packs == 0:
            limit = 1  # every leaf alone
        elif not limit and num_packs > 1:
            limit = max(1, -(-total // num_packs))
        for chunk in _split_by_bytes(indices, leaves, limit):
            leaf = leaves[chunk[0]]
            if borrow and len(chunk) == 1 and leaf.flags.c_contiguous:
                packs.append(Pack(chunk, leaf.reshape(-1), borrowed=not in_place))
            else:
                packs.append(Pack(chunk, _concatenate([leaves[i] for i in chunk], allocate)))
    return PackedStructure(treedef, [tuple(leaf.shape) for leaf in leaves], restore, packs)


def _split_by_bytes(indices: list[int], leaves: list[Any], limit: int) -> list[list[int]]:
    if not limit:
        return [indices]
    chunks: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in indices:
        if current and size + leaves[i].nbytes > limit:
            chunks.append(current)
            current, size = [], 0
        current.append(i)
        size += leaves[i].nbytes
    chunks.append(current)
    return chunks


def _concatenate(arrays: list[Any], allocate: Callable[[int, Any], Any] | None = None) -> Any:
    xp = namespace(arrays[0])
    if allocate is not None and xp is np:
        out = allocate(sum(a.size for a in arrays), arrays[0].dtype)
        offset = 0
        for a in arrays:
            out[offset : offset + a.size] = a.reshape(-1)
            offset += a.size
        return out
    if len(arrays) == 1:
        return xp.array(arrays[0], copy=True).reshape(-1)
    return xp.concatenate([xp.reshape(a, (-1,)) for a in arrays])
