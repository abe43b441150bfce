"""TensorFlow device strings: ``"/cpu:0"``, ``"GPU:1"``, ``"/job:localhost/replica:0/task:0/device:GPU:1"``."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["DeviceSpec", "parse_device", "parse_devices"]

_FIELD = re.compile(r"^(job|replica|task|device):(.+)$", re.IGNORECASE)
_DEVICE = re.compile(r"^(cpu|gpu)(?::(\d+))?$", re.IGNORECASE)


@dataclass(frozen=True, order=True)
class DeviceSpec:
    """One device: its type (``"CPU"`` or ``"GPU"``) and index, on the local job."""

    device_type: str
    index: int

    def to_string(self) -> str:
        """The canonical TF form, ``/job:localhost/replica:0/task:0/device:CPU:0``."""
        return f"/job:localhost/replica:0/task:0/device:{self.device_type}:{self.index}"

    def __str__(self) -> str:
        return self.to_string()


def parse_device(text: str) -> DeviceSpec:
    """Parse one TF device string.

    Raises
    ------
    ValueError
        Unknown device types, malformed strings, or a job/task other than the
        local one (``MirroredStrategy`` is single-job; use
        ``MultiWorkerMirroredStrategy`` for several tasks).
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"Device must be a non-empty string like '/cpu:0' or '/gpu:1', got {text!r}")
    parts = [p for p in text.strip().split("/") if p]
    device: DeviceSpec | None = None
    for part in parts:
        field_match = _FIELD.match(part)
        if field_match:
            key, value = field_match.group(1).lower(), field_match.group(2)
            if key == "device":
                device = _parse_type(value, text)
            elif key == "job" and value != "localhost":
                raise ValueError(f"Device {text!r}: only job 'localhost' is supported by this strategy")
            elif key in ("replica", "task") and value != "0":
                raise ValueError(f"Device {text!r}: only {key} 0 is supported by this strategy")
            continue
        device = _parse_type(part, text)
    if device is None:
        raise ValueError(f"Device {text!r} names no device type; expected e.g. '/cpu:0' or '/gpu:0'")
    return device


def _parse_type(part: str, text: str) -> DeviceSpec:
    match = _DEVICE.match(part)
    if not match:
        raise ValueError(f"Unknown device {text!r}; expected CPU or GPU devices such as '/cpu:0' or '/gpu:1'")
    return DeviceSpec(match.group(1).upper(), int(match.group(2) or 0))


def parse_devices(devices: list[str] | tuple[str, ...]) -> list[DeviceSpec]:
    """Parse a list of device strings; reject duplicates, mixed types and empty lists."""
    if isinstance(devices, str):
        raise TypeError("devices must be a list of device strings, not a single string")
    specs = [parse_device(d) for d in devices]
    if not specs:
        raise ValueError("devices must name at least one device")
    seen = set()
    for text, spec in zip(devices, specs):
        if spec in seen:
            raise ValueError(f"Device {text!r} is listed twice")
        seen.add(spec)
    if len({s.device_type for s in specs}) > 1:
        raise ValueError("Mixing CPU and GPU devices in one strategy is not supported; list only GPUs or only CPUs")
    return specs
