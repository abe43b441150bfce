"""``ClusterSpec``: jobs of tasks and their addresses (TF's ``tf.train.ClusterSpec``).

Same constructor, methods, errors and equality as TensorFlow's class; there is
no ``ClusterDef`` protocol buffer here, so ``as_cluster_def`` is missing and a
copy made from another ``ClusterSpec`` orders its jobs and tasks as TF's copy
(which goes through the sorted ``ClusterDef``) does.
"""

from __future__ import annotations

from typing import Any

__all__ = ["ClusterSpec"]

#: What a job may be given as: a dense list of addresses, or a sparse ``{index: address}`` mapping.
JobTasks = list[Any] | tuple[Any, ...] | dict[str, Any]


def _as_text(value: Any, what: str) -> str:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, str):
        return value
    raise TypeError(f"{what} {value!r} must be bytes or unicode")


class ClusterSpec:
    """A cluster as a set of tasks, organised into jobs (TF's ``tf.train.ClusterSpec``).

    Parameters
    ----------
    cluster
        A dict mapping job names to a list of addresses (dense task indices
        0..n-1) or to a dict ``{task_index: address}`` (sparse), or another
        ``ClusterSpec``.

    Raises
    ------
    TypeError
        ``cluster`` is neither, a job's tasks are neither a list nor a dict,
        or a job name or address is not a string.

    Examples
    --------
    >>> spec = ClusterSpec({"worker": ["host-a:2222", "host-b:2222"], "ps": {1: "ps1:2222"}})
    >>> spec.num_tasks("worker"), spec.task_address("ps", 1), spec.job_tasks("ps")
    (2, 'ps1:2222', [None, 'ps1:2222'])
    """

    def __init__(self, cluster: dict[str, JobTasks] | ClusterSpec):
        if isinstance(cluster, dict):
            self._cluster_spec: dict[str, dict[int, str]] = {}
            for job_name, tasks in cluster.items():
                if isinstance(tasks, (list, tuple)):
                    job = dict(enumerate(tasks))
                elif isinstance(tasks, dict):
                    job = {int(i): task for i, task in tasks.items()}
                else:
                    raise TypeError(
                        f"The tasks for job {job_name!r} must be a list or a dictionary from integers to strings."
                    )
                self._cluster_spec[job_name] = job
            self._validate()
        elif isinstance(cluster, ClusterSpec):
            # TF copies through its ClusterDef, sorted by job name and task index
            self._cluster_spec = {
                _as_text(name, "Job name"): {i: _as_text(t, "Task address") for i, t in sorted(tasks.items())}
                for name, tasks in sorted(cluster._cluster_spec.items())
            }
        else:
            raise TypeError(
                "`cluster` must be a dictionary mapping one or more job names to lists of network addresses, "
                "or a `ClusterSpec`"
            )

    def _validate(self) -> None:
        """TF's ``_make_cluster_def`` checks: job names and addresses are text."""
        for job_name, tasks in self._cluster_spec.items():
            _as_text(job_name, "Job name")
            for address in tasks.values():
                _as_text(address, "Task address")

    def __bool__(self) -> bool:
        return bool(self._cluster_spec)

    def __eq__(self, other: object) -> bool:
        return self._cluster_spec == other

    def __ne__(self, other: object) -> bool:
        return self._cluster_spec != other

    __hash__ = None  # type: ignore[assignment]  # mutable-style equality with dicts, as TF's

    def __repr__(self) -> str:
        key_values = self.as_dict()
        items = [f"{k!r}: {key_values[k]!r}" for k in sorted(key_values)]
        return "ClusterSpec({" + ", ".join(items) + "})"

    def as_dict(self) -> dict[str, list[str | None] | dict[int, str]]:
        """Job name -> a list of addresses when its task indices are dense, else ``{index: address}``."""
        result: dict[str, list[str | None] | dict[int, str]] = {}
        for job in self.jobs:
            indices = self.task_indices(job)
            if not indices:
                result[job] = {}
            elif max(indices) + 1 == len(indices):
                result[job] = self.job_tasks(job)
            else:
                result[job] = {i: self.task_address(job, i) for i in indices}
        return result

    @property
    def jobs(self) -> list[str]:
        """The job names, in the order they were given."""
        return list(self._cluster_spec.keys())

    def _job(self, job_name: str) -> dict[int, str]:
        try:
            return self._cluster_spec[job_name]
        except KeyError:
            raise ValueError(f"No such job in cluster: {job_name!r}") from None

    def num_tasks(self, job_name: str) -> int:
        """How many tasks ``job_name`` has (``ValueError`` for an unknown job)."""
        return len(self._job(job_name))

    def task_indices(self, job_name: str) -> list[int]:
        """The task indices of ``job_name``, sorted."""
        return sorted(self._job(job_name).keys())

    def task_address(self, job_name: str, task_index: int) -> str:
        """The address of task ``task_index`` of ``job_name`` (``ValueError`` if there is none)."""
        job = self._job(job_name)
        try:
            return job[task_index]
        except KeyError:
            raise ValueError(f"No task with index {task_index!r} in job {job_name!r}") from None

    def job_tasks(self, job_name: str) -> list[str | None]:
        """The addresses of ``job_name`` indexed by task, ``None`` where a sparse job has a hole."""
        job = self._job(job_name)
        tasks: list[str | None] = [None] * (max(job.keys()) + 1)
        for i, task in job.items():
            tasks[i] = task
        return tasks
