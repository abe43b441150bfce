"""``TFConfigClusterResolver``: the cluster described by the ``TF_CONFIG`` environment variable."""

from __future__ import annotations

import json
import os
from typing import Any

from daskdist.cluster_resolver.base import ClusterResolver, format_master_url
from daskdist.cluster_resolver.cluster_spec import ClusterSpec

__all__ = ["TFConfigClusterResolver", "load_tf_config"]

_TF_CONFIG_ENV = "TF_CONFIG"


def load_tf_config() -> dict[str, Any]:
    """``TF_CONFIG`` parsed (``{}`` when unset).

    Raises
    ------
    ValueError
        ``TF_CONFIG`` is not a JSON object; the message names the variable and
        gives the JSON error (TensorFlow lets ``json.JSONDecodeError`` escape,
        which is a ``ValueError`` too).
    """
    text = os.environ.get(_TF_CONFIG_ENV, "{}")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"The {_TF_CONFIG_ENV} environment variable is not valid JSON: {e} "
                         f"({_TF_CONFIG_ENV}={text!r})") from e
    if not isinstance(config, dict):  # TF fails later on it; a ValueError like the JSON error
        raise ValueError(  # noqa: TRY004
            f"The {_TF_CONFIG_ENV} environment variable must hold a JSON object, "
            f"got {type(config).__name__}: {text!r}")
    return config


def _value_in_tf_config(key: str, default: Any = None) -> Any:
    return load_tf_config().get(key, default)


class TFConfigClusterResolver(ClusterResolver):
    """The cluster in ``TF_CONFIG`` (TF's ``TFConfigClusterResolver``).

    ``TF_CONFIG`` is JSON: ``cluster`` (job -> addresses), ``task``
    (``{"type", "index"}``), and optionally ``rpc_layer`` and
    ``session_master``. The variable is read again on every call.

    Parameters
    ----------
    task_type, task_id, rpc_layer, environment
        Override what ``TF_CONFIG`` says.

    Examples
    --------
    >>> os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": ["h1:2222", "h2:2222"]},
    ...                                       "task": {"type": "worker", "index": 0}})
    >>> TFConfigClusterResolver().cluster_spec().as_dict()
    {'worker': ['h1:2222', 'h2:2222']}
    """

    def __init__(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None,
                 environment: str | None = None):
        self._task_type = task_type
        self._task_id = task_id
        self._rpc_layer = rpc_layer
        self._environment = environment

    @property
    def task_type(self) -> str | None:
        if self._task_type is None:
            task_info = _value_in_tf_config("task", {})
            return str(task_info["type"]) if "type" in task_info else None
        return str(self._task_type)

    @task_type.setter
    def task_type(self, task_type: str | None) -> None:
        self._task_type = task_type

    @property
    def task_id(self) -> int | None:
        if self._task_id is None:
            task_info = _value_in_tf_config("task", {})
            return int(task_info["index"]) if "index" in task_info else None
        return int(self._task_id)

    @task_id.setter
    def task_id(self, task_id: int | None) -> None:
        self._task_id = task_id

    @property
    def environment(self) -> str | None:  # type: ignore[override]  # TF returns None unless given
        return self._environment

    @property
    def rpc_layer(self) -> str | None:
        if self._rpc_layer is None:
            layer: str | None = _value_in_tf_config("rpc_layer")
            return layer
        return self._rpc_layer

    @rpc_layer.setter
    def rpc_layer(self, rpc_layer: str | None) -> None:
        self._rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        """``TF_CONFIG``'s ``cluster`` as a ``ClusterSpec`` (empty when it has none)."""
        config = load_tf_config()
        if "cluster" not in config:
            return ClusterSpec({})
        return ClusterSpec(config["cluster"])

    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """``session_master`` if set; ``""`` for a one-task cluster; else ``rpc_layer://address`` of the task.

        Raises
        ------
        ValueError
            The task (given, or from ``TF_CONFIG``) is not in the cluster.
        """
        session_master = _value_in_tf_config("session_master")
        if session_master is not None:
            return str(session_master)
        spec = self.cluster_spec()
        if not spec.jobs or (len(spec.jobs) == 1 and len(spec.job_tasks(spec.jobs[0])) == 1):
            return ""
        task_type = task_type if task_type is not None else self.task_type
        task_id = task_id if task_id is not None else self.task_id
        rpc_layer = rpc_layer if rpc_layer is not None else self.rpc_layer
        if task_type is None:  # TF's ClusterSpec raises these for a missing task
            raise ValueError(f"No such job in cluster: {task_type!r}")
        if task_id is None:
            raise ValueError(f"No task with index {task_id!r} in job {task_type!r}")
        return format_master_url(spec.task_address(task_type, task_id), rpc_layer)
