"""``ClusterResolver`` and ``SimpleClusterResolver`` (TF's ``tf.distribute.cluster_resolver``)."""

from __future__ import annotations

import abc
from typing import Any

from daskdist.cluster_resolver.cluster_spec import ClusterSpec

__all__ = ["ClusterResolver", "SimpleClusterResolver", "format_master_url"]


def format_master_url(master: str, rpc_layer: str | None = None) -> str:
    """``rpc_layer://master``, or ``master`` as is without an RPC layer (TF's helper)."""
    return f"{rpc_layer}://{master}" if rpc_layer else master


class ClusterResolver(abc.ABC):
    """Where the tasks of a cluster are, and which one this program is (TF's ``ClusterResolver``).

    Subclasses implement ``cluster_spec()`` (fresh on every call: ask the
    cluster manager each time, cache nothing) and ``master()``. ``task_type``,
    ``task_id`` and ``rpc_layer`` read ``self._task_type`` / ``_task_id`` /
    ``_rpc_layer`` and can be set.
    """

    @abc.abstractmethod
    def cluster_spec(self) -> ClusterSpec:
        """The cluster as it is now, as a ``ClusterSpec``."""

    @abc.abstractmethod
    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """The name or URL of the session master (meaningful in TF1 only)."""

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        """Accelerators per worker, ``{device_type: count}``.

        TensorFlow's base class asks a TF session; daskdist has none, so the
        base returns ``{}`` (no accelerators known). Subclasses that know (the
        Dask resolver, a ``SimpleClusterResolver`` given a count) override it.
        """
        return {}

    @property
    def environment(self) -> str:
        """``"google"`` inside Google, ``""`` elsewhere (always ``""`` here)."""
        return ""

    @property
    def task_type(self) -> str | None:
        """This program's job name (``"worker"``, ``"chief"``, ``"ps"``, ``"evaluator"``), or ``None``."""
        return getattr(self, "_task_type", None)

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        """This program's index within its job, or ``None``."""
        return getattr(self, "_task_id", None)

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id


class SimpleClusterResolver(ClusterResolver):
    """A resolver that returns what it was given (TF's ``SimpleClusterResolver``).

    Parameters
    ----------
    cluster_spec
        A ``ClusterSpec`` (``TypeError`` otherwise).
    master
        The master string (``TypeError`` if not a string).
    task_type, task_id, environment, num_accelerators, rpc_layer
        Returned as given; ``num_accelerators`` ``None`` reads as ``{}``.
    """

    def __init__(self, cluster_spec: ClusterSpec, master: str = "", task_type: str | None = None,
                 task_id: int | None = None, environment: str = "", num_accelerators: dict[str, int] | None = None,
                 rpc_layer: str | None = None):
        self._task_type = task_type
        self._task_id = task_id
        self._environment = environment
        self._num_accelerators = num_accelerators
        self._rpc_layer = rpc_layer
        if not isinstance(cluster_spec, ClusterSpec):
            raise TypeError("cluster_spec must be a `ClusterSpec`.")
        self._cluster_spec = cluster_spec
        if not isinstance(master, str):
            raise TypeError("master must be a string.")
        self._master = master

    def cluster_spec(self) -> ClusterSpec:
        """The ``ClusterSpec`` given to the constructor."""
        return self._cluster_spec

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """The given master, or the address of ``task_type``/``task_id`` when both are given."""
        if task_type is not None and task_id is not None:
            master = self.cluster_spec().task_address(task_type, task_id)
        else:
            master = self._master
        return format_master_url(master, rpc_layer=rpc_layer or self._rpc_layer)

    @property
    def environment(self) -> str:
        return self._environment

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None,
                         config_proto: Any = None) -> dict[str, int]:
        """The count given to the constructor (``{}`` when none was)."""
        return {} if self._num_accelerators is None else self._num_accelerators

    @property
    def rpc_layer(self) -> str | None:
        return self._rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer
