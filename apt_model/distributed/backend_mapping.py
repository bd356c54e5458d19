"""Which ``torch.distributed`` backend a process group uses on this machine.

There is no table here: each device kind's backend is its :class:`AcceleratorBackend`'s
``dist_backend`` (cuda/rocm/dcu ``nccl``, npu ``hccl``, mlu ``cncl``, xpu ``xccl``, cpu ``gloo``,
mps none — DESIGN.md section 5), read from the registered backends, and the switch's own choice is
the *selected* device's candidate (``Selection.candidate.dist_backend``) — the one ranking policy.

A script written for one vendor names that vendor's backend: ``init_process_group("nccl")``.
On a machine without that vendor's devices the call cannot work, so the name is mapped to the
selected kind's backend (``nccl`` -> ``hccl`` on an Ascend machine, as torch_npu users expect;
``nccl`` -> ``gloo`` on a CPU-only machine). A backend whose devices *are* present, ``gloo``, and
names no kind claims (``mpi``, ``ucc``, a plugin's) are kept as written.
"""
from __future__ import annotations

from dataclasses import dataclass

from apt_model.base.errors import DistributedError


@dataclass(frozen=True)
class BackendChoice:
    """A backend decision.

    Attributes:
        requested: what the script asked for (None: torch's default per device type).
        chosen: what is passed to torch (None: torch's default).
        reason: one sentence for the report.
    """

    requested: str | None
    chosen: str | None
    reason: str

    @property
    def mapped(self) -> bool:
        """Whether the chosen backend differs from the requested one."""
        return self.requested != self.chosen

    def to_dict(self) -> dict:
        return {"requested": self.requested, "chosen": self.chosen, "mapped": self.mapped, "reason": self.reason}


def backend_owners() -> dict[str, set[str]]:
    """``{backend name: device types of the registered kinds that use it}``.

    From the registered device backends' ``dist_backend`` (built-in and plugins alike), e.g.
    ``{"nccl": {"cuda"}, "hccl": {"npu"}, "cncl": {"mlu"}, "xccl": {"xpu"}, "gloo": {"cpu"}}``.
    """
    from apt_model.devices.registry import registered_backends

    owners: dict[str, set[str]] = {}
    for b in registered_backends():
        if b.dist_backend:
            owners.setdefault(b.dist_backend, set()).add(b.device_type)
    return owners


def own_backend(candidate) -> tuple[str | None, str]:
    """The backend the switch initializes with for the selected ``candidate`` (a detection
    :class:`~apt_model.devices.detection.Candidate`), and why; ``(None, reason)`` when the kind
    has no collective library (MPS)."""
    if candidate.dist_backend:
        return candidate.dist_backend, f"{candidate.dist_backend} is the collective library of {candidate.kind}, the selected device kind"
    return None, (f"{candidate.kind} has no collective communication library (no dist_backend); gloo with "
                  f"{candidate.kind} tensors is not verified by this project, so the switch does not "
                  "initialize a process group: initialize one yourself with backend='gloo' and CPU tensors, "
                  "or run on device='cpu'")


def _map_name(name: str, candidate, available_types: set[str], owners: dict[str, set[str]]) -> tuple[str, str]:
    kinds = owners.get(name)
    if kinds is None:
        return name, f"{name} is not a device kind's backend here: kept as written"
    if candidate.device_type in kinds:
        return name, f"{name} is the backend of the selected device kind {candidate.kind}"
    present = sorted(kinds & available_types)
    if present:
        return name, f"{name} serves {', '.join(present)}, present on this machine: kept as written"
    target, why = own_backend(candidate)
    needs = "/".join(sorted(kinds))
    if target is None:
        raise DistributedError(f"backend {name!r} needs {needs} devices, which are absent here, and {why}")
    return target, f"{name} needs {needs} devices, absent here: mapped to {target}, the backend of the selected device kind {candidate.kind}"


def map_backend(requested, candidate, available_types: set[str] | None = None) -> BackendChoice:
    """Map the backend a script asked for to one that works with the selected device.

    Args:
        requested: a backend name (``"nccl"``, ``dist.Backend.NCCL``), a per-device string
            (``"cpu:gloo,cuda:nccl"``), or None (torch's default per device type; kept).
        candidate: the selected device's :class:`~apt_model.devices.detection.Candidate`.
        available_types: device types with usable devices here (default: from detection).

    Returns:
        A :class:`BackendChoice`.

    Raises:
        DistributedError: the backend needs devices that are absent and the selected kind has no
            collective library to map it to (MPS); the message says what to use instead.
        ConfigError: ``requested`` is not a string or None.
    """
    if requested is None:
        return BackendChoice(None, None, "no backend named: torch's default for each device type")
    if not isinstance(requested, str):
        from apt_model.base.errors import ConfigError

        raise ConfigError(f"backend={requested!r} is not a backend name; use e.g. 'nccl', 'hccl', 'gloo' "
                          "or 'cpu:gloo,cuda:nccl'")
    if available_types is None:
        from apt_model.devices.detection import detect_devices

        available_types = {c.device_type for c in detect_devices() if c.available}
    owners = backend_owners()
    text = str(requested).strip().lower()
    if ":" not in text:
        chosen, why = _map_name(text, candidate, available_types, owners)
        return BackendChoice(str(requested), chosen, why)
    pairs, notes = [], []
    named = [part.partition(":")[0].strip() for part in text.split(",")]
    for part in text.split(","):
        dev, _, name = (x.strip() for x in part.partition(":"))
        if dev in available_types:
            pairs.append(f"{dev}:{name}")
            continue
        target, _ = own_backend(candidate)
        if target is None or candidate.device_type in named:
            notes.append(f"{dev}:{name} dropped ({dev} is absent here)")
            continue
        pairs.append(f"{candidate.device_type}:{target}")
        notes.append(f"{dev}:{name} -> {candidate.device_type}:{target} ({dev} is absent; {candidate.kind} is selected)")
    if not notes:
        return BackendChoice(str(requested), str(requested), "every device type named is present: kept as written")
    if not pairs:
        raise DistributedError(f"backend {requested!r}: none of its device types is present here; "
                               f"{own_backend(candidate)[1]}")
    return BackendChoice(str(requested), ",".join(pairs), "; ".join(notes))
