"""Device strings and replica placement (pure functions)."""

from __future__ import annotations

import pytest

from daskdist.cluster.devices import DeviceSpec, parse_device, parse_devices
from daskdist.cluster.placement import WorkerInfo, place_replicas


@pytest.mark.parametrize(
    "text, expected",
    [
        ("/cpu:0", DeviceSpec("CPU", 0)),
        ("CPU:1", DeviceSpec("CPU", 1)),
        ("/gpu:0", DeviceSpec("GPU", 0)),
        ("/GPU:3", DeviceSpec("GPU", 3)),
        ("/device:CPU:2", DeviceSpec("CPU", 2)),
        ("/job:localhost/replica:0/task:0/device:GPU:1", DeviceSpec("GPU", 1)),
        ("cpu", DeviceSpec("CPU", 0)),
    ],
)
def test_parse_device(text, expected):
    assert parse_device(text) == expected
    assert parse_device(expected.to_string()) == expected


@pytest.mark.parametrize("text", ["", "/tpu:0", "cpu:-1", "/job:localhost/device:XPU:0", "/job:worker/cpu:0", "/task:1/cpu:0"])
def test_parse_device_rejects(text):
    with pytest.raises(ValueError):
        parse_device(text)


def test_parse_devices_rejects_duplicates_and_mixtures():
    assert parse_devices(["/cpu:0", "CPU:1"]) == [DeviceSpec("CPU", 0), DeviceSpec("CPU", 1)]
    with pytest.raises(ValueError, match="twice"):
        parse_devices(["/cpu:0", "/device:CPU:0"])
    with pytest.raises(ValueError, match="Mixing"):
        parse_devices(["/cpu:0", "/gpu:0"])
    with pytest.raises(TypeError):
        parse_devices("/cpu:0")


def _workers(gpus=(0, 0, 0)):
    return [WorkerInfo(f"tcp://h:{100 + i}", name=str(i), host="h", gpus=g) for i, g in enumerate(gpus)]


def test_default_placement_one_replica_per_worker_in_name_order():
    workers = list(reversed(_workers()))
    names = ["10", "2", "1"]
    workers = [WorkerInfo(f"tcp://h:{n}", name=n, host="h") for n in names]
    placed = place_replicas(workers, None)
    assert [p.address for p in placed] == ["tcp://h:1", "tcp://h:2", "tcp://h:10"]
    assert [p.rank for p in placed] == [0, 1, 2]
    assert all(p.device.device_type == "CPU" for p in placed)


def test_gpu_workers_are_preferred_and_selected_by_index():
    workers = _workers(gpus=(0, 1, 1))
    placed = place_replicas(workers, None)
    assert [p.address for p in placed] == ["tcp://h:101", "tcp://h:102"]
    assert [p.device for p in placed] == [DeviceSpec("GPU", 0), DeviceSpec("GPU", 1)]
    placed = place_replicas(workers, parse_devices(["/gpu:1"]))
    assert [p.address for p in placed] == ["tcp://h:102"]
    placed = place_replicas(workers, parse_devices(["/cpu:0"]))
    assert [p.address for p in placed] == ["tcp://h:100"]


def test_impossible_placements():
    with pytest.raises(ValueError, match="no workers"):
        place_replicas([], None)
    with pytest.raises(ValueError, match="no worker of this cluster has a GPU"):
        place_replicas(_workers(), parse_devices(["/gpu:0"]))
    with pytest.raises(ValueError, match="only 3 CPU"):
        place_replicas(_workers(), parse_devices(["/cpu:3"]))
