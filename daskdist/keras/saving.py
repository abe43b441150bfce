"""Checkpoints and saved models: safetensors weights plus a JSON config, written atomically.

Nothing is ever unpickled on load. Every file is written to a temporary
name in the same directory and moved into place with ``os.replace``, so a
crash mid-write leaves the previous checkpoint intact. The JSON next to the
weights records their SHA-256, checked on load.

A checkpoint ``prefix`` is two files, ``prefix.safetensors`` and
``prefix.json``; a directory of checkpoints has a ``checkpoint`` file naming
the latest one (as TensorFlow's ``latest_checkpoint`` expects).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from typing import Any

import numpy as np

from daskdist.exceptions import CheckpointError

__all__ = [
    "CheckpointError",
    "latest_checkpoint",
    "read_checkpoint",
    "read_json",
    "write_checkpoint",
    "write_json",
]

_STATE_FILE = "checkpoint"


def _atomic_write(path: str, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: str, content: dict[str, Any]) -> None:
    _atomic_write(path, json.dumps(content, indent=2, sort_keys=True).encode())


def read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            content: dict[str, Any] = json.load(f)
            return content
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None


def write_checkpoint(prefix: str, tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    """Write ``prefix.safetensors`` and ``prefix.json`` (weights first, then the JSON that vouches for them)."""
    from safetensors.numpy import save

    data = save({name: np.ascontiguousarray(array) for name, array in tensors.items()})
    _atomic_write(prefix + ".safetensors", data)
    write_json(prefix + ".json", {**meta, "sha256": hashlib.sha256(data).hexdigest(), "format": "daskdist-1"})
    directory = os.path.dirname(os.path.abspath(prefix))
    write_json(os.path.join(directory, _STATE_FILE), {"latest": os.path.basename(prefix)})


def read_checkpoint(prefix: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Read and verify a checkpoint; ``CheckpointError`` if it is missing or damaged."""
    from safetensors.numpy import load

    if prefix.endswith(".safetensors") or prefix.endswith(".json"):
        prefix = prefix.rsplit(".", 1)[0]
    meta = read_json(prefix + ".json")
    try:
        with open(prefix + ".safetensors", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{prefix}.safetensors does not exist") from None
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise CheckpointError(f"{prefix}.safetensors does not match its checksum: the file is damaged")
    try:
        tensors = load(data)
    except Exception as e:
        raise CheckpointError(f"{prefix}.safetensors cannot be read: {e}") from None
    return tensors, meta


def latest_checkpoint(checkpoint_dir: str) -> str | None:
    """The prefix of the newest checkpoint in ``checkpoint_dir`` (TF's ``tf.train.latest_checkpoint``)."""
    state = os.path.join(checkpoint_dir, _STATE_FILE)
    if not os.path.exists(state):
        return None
    name = read_json(state).get("latest")
    if not name:
        return None
    prefix = os.path.join(checkpoint_dir, name)
    return prefix if os.path.exists(prefix + ".json") else None

