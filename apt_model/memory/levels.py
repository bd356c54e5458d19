"""The VGPU stack: the memory levels a run can use, with real capacities and measured bandwidths.

Level 0 is the compute device's memory, Level 1 host RAM (pinned on accelerators), Level 2 the
swap files. On a CPU-only machine the compute memory *is* host RAM, so the stack has one host
level (with its budget) and then the swap level. Capacities come from real free memory minus a
headroom, or from the user's budgets; bandwidths from :mod:`apt_model.memory.bandwidth`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import psutil
import torch

from apt_model.base.log import get_logger
from apt_model.base.settings import Setting, read_env
from apt_model.base.sizes import format_size, parse_size
from apt_model.memory.host import align_big_allocations
from apt_model.memory.settings import DEVICE_BUDGET, HOST_BUDGET, SWAP_BUDGET
from apt_model.memory.swap import SwapSpace

log = get_logger(__name__)

#: Fraction of free memory left alone by default ("over_budget" paging) and in "tight" mode.
HEADROOM = {"over_budget": 0.10, "tight": 0.50}



@dataclass
class Level:
    """One memory level.

    Attributes:
        index: 0 = compute memory, then down the hierarchy.
        kind: ``device``, ``host`` or ``nvme``.
        device: what backs it (``cuda:0``, ``cpu``, ``nvme:<folder>``).
        capacity: bytes this run may use on the level.
        gbps: headline bandwidth in GB/s (memory: read+write copy rate; NVMe: the slower of read
            and write); None when not measured.
        detail: the measured figures behind it.
        note: e.g. that the compute and host levels are the same memory.
    """

    index: int
    kind: str
    device: str
    capacity: int
    gbps: float | None
    detail: dict = field(default_factory=dict)
    note: str = ""

    def __str__(self) -> str:
        """``Level 0: cuda:0 - 71000MB @ 2900.0GB/s``; the swap level reads
        ``Level 2: nvme - 32000MB @ 0.7GB/s (/tmp/...; read 0.70, write 0.80 GB/s)`` (MB = 10**6
        bytes, GB/s = 10**9 bytes/s), its folder and measured figures in the parentheses."""
        bw = f" @ {self.gbps:.1f}GB/s" if self.gbps is not None else " @ (not measured)"
        label, extra = self.device, ""
        if self.kind == "nvme":
            label = "nvme"
            parts = [self.device.split(":", 1)[1] if self.device.startswith("nvme:") else self.device]
            if self.detail:
                parts.append(f"read {self.detail.get('read', 0):.2f}, write {self.detail.get('write', 0):.2f} GB/s")
            extra = f" ({'; '.join(parts)})"
        note = f" [{self.note}]" if self.note else ""
        return f"Level {self.index}: {label} - {self.capacity / 1e6:.0f}MB{bw}{extra}{note}"


def resolve_budget(value, setting: Setting) -> int | None:
    """A budget in bytes from an explicit value, else ``setting``'s variable, else None.

    Args:
        value: bytes or a size string (``"512MB"``), or None.
        setting: the budget's entry (:data:`~apt_model.memory.settings.DEVICE_BUDGET`, ...).

    Raises:
        ConfigError: a malformed size, naming ``setting``'s name (or its variable) and the value.
    """
    if value is not None:
        return parse_size(value, setting.name)
    found = read_env(setting)
    return None if found is None else parse_size(found[0], setting.env)


def _device_total(device: torch.device) -> int | None:
    from apt_model.devices.device_backend import DeviceBackend

    try:
        total = DeviceBackend(device).total_memory()
    except Exception:  # noqa: BLE001 - a figure the backend cannot give: no check
        return None
    return int(total) if total else None


def capacity_warnings(device: torch.device, device_budget: int | None, host_budget: int | None,
                      swap_budget: int | None, swap_free: int | None) -> list[str]:
    """Budgets larger than what their level has, each as a sentence naming the level's capacity
    and what will happen (the switch trusts a budget: it pages nothing that fits under it).

    Args:
        device: the compute device. device_budget / host_budget / swap_budget: bytes or None.
        swap_free: free bytes on the swap folder's disk (None: unknown).
    """
    ram = int(psutil.virtual_memory().total)
    out = []

    def size(n: int) -> str:
        return f"{n} bytes ({format_size(n)})"

    if device.type == "cpu":
        for name, value in (("device_budget", device_budget), ("host_budget", host_budget)):
            if value and value > ram:
                out.append(f"{name} {size(value)} exceeds this machine's RAM ({format_size(ram)}): on a CPU-only run "
                           f"level 0 is host RAM, and training state up to {format_size(value)} is treated as fitting "
                           "and never paged, so a larger model will be swapped by the OS or killed for memory instead "
                           f"of paged to the swap files; set it below {format_size(ram)} or leave it unset")
    else:
        total = _device_total(device)
        if device_budget and total and device_budget > total:
            out.append(f"device_budget {size(device_budget)} exceeds {device}'s memory ({format_size(total)}): training "
                       f"state up to {format_size(device_budget)} is treated as fitting and never paged, so a model "
                       "that does not fit the device fails with an out-of-memory error instead of being paged to "
                       f"host RAM; set it below {format_size(total)} or leave it unset")
        if host_budget and host_budget > ram:
            out.append(f"host_budget {size(host_budget)} exceeds this machine's RAM ({format_size(ram)}): the host "
                       "level will try to pin more memory than there is, and fail or push the system into its own "
                       f"swap; set it below {format_size(ram)} or leave it unset")
    if swap_budget and swap_free is not None and swap_budget > swap_free:
        out.append(f"swap_budget {size(swap_budget)} exceeds the free space of the swap folder's disk "
                   f"({format_size(swap_free)}): once the disk fills, evictions fail with SwapFullError (the pages "
                   "stay in memory, nothing is lost, but memory goes over its budget); free space or lower it")
    return out


def _device_free(device: torch.device) -> int:
    from apt_model.devices.device_backend import DeviceBackend

    free = DeviceBackend(device).free_memory()
    return int(free) if free is not None else int(psutil.virtual_memory().available)


class VGPUStack:
    """The levels for one device, and the swap space behind them.

    Args:
        device: the compute device.
        device_budget / host_budget / swap_budget: bytes (or size strings like ``"512MB"``);
            None reads ``VB_DEVICE_BUDGET`` / ``VB_HOST_BUDGET`` / ``VB_SWAP_BUDGET``, else uses
            free memory (or disk) minus ``headroom``.
        swap_dir: the swap folder's parent (``VB_SWAP_DIR`` or the system temp folder).
        headroom: fraction of free memory left alone when no budget is given.
        measure: measure bandwidths now (else the levels show "not measured" until
            :meth:`measure` is called).
        sharing: processes of one job on this host (a launcher's ``LOCAL_WORLD_SIZE``): a level
            sized by default from the host's free RAM or the swap disk's free space takes 1/N of
            it, since N ranks each start with the same free memory in view (until 2026-11-28 each
            rank took 90% of it: 8 ranks could pin and swap 8x what the host has). A budget given
            explicitly is this process's own. A device level is per rank and never divided.

    Budgets above what their level has (more than the machine's RAM, the device's memory, the
    swap disk's free space) are accepted with a warning naming the capacity and the consequence
    (:func:`capacity_warnings`; also in :attr:`warnings` and :meth:`describe`).

    Raises:
        ConfigError: a malformed budget (not a whole number of bytes >= 1), or a swap dir that is
            missing or not writable.
    """

    def __init__(self, device: torch.device | str = "cpu", device_budget=None, host_budget=None,
                 swap_dir=None, swap_budget=None, headroom: float = HEADROOM["over_budget"], measure: bool = True,
                 sharing: int = 1):
        if not isinstance(sharing, int) or isinstance(sharing, bool) or sharing < 1:
            raise ValueError(f"sharing={sharing!r} must be a whole number of processes >= 1")
        self.device = torch.device(device)
        self.headroom = headroom
        self.sharing = sharing
        self.device_budget = resolve_budget(device_budget, DEVICE_BUDGET)
        self.host_budget = resolve_budget(host_budget, HOST_BUDGET)
        self.swap_budget = resolve_budget(swap_budget, SWAP_BUDGET)
        self.swap = SwapSpace(swap_dir, self.swap_budget)
        self.warnings = capacity_warnings(self.device, self.device_budget, self.host_budget, self.swap_budget,
                                          self.swap.free_bytes())
        for w in self.warnings:
            log.warning("%s", w)
        # on a CPU-only run the pages are host tensors: aligned ones skip O_DIRECT's staging copy
        self.aligned_pages = align_big_allocations() if self.device.type == "cpu" else None
        self.bandwidths: dict | None = None
        self.levels: list[Level] = []
        self._build()
        if measure:
            self.measure()

    @property
    def shared_host(self) -> bool:
        """True on a CPU-only run: the compute level and the host level are the same memory."""
        return self.device.type == "cpu"

    @property
    def compute_budget(self) -> int:
        """Bytes of training state Level 0 may hold."""
        return self.levels[0].capacity

    @property
    def budget_setting(self) -> str:
        """The setting that sets level 0's capacity, as errors name it: on a CPU-only run the
        smaller of ``device_budget`` and ``host_budget`` (the same memory), else ``device_budget``."""
        if self.shared_host and self.host_budget and not (self.device_budget and self.device_budget <= self.host_budget):
            return "host_budget (VB_HOST_BUDGET)"
        return "device_budget (VB_DEVICE_BUDGET)"

    def _build(self) -> None:
        avail = int(psutil.virtual_memory().available) // self.sharing  # this rank's share (see ``sharing``)
        host_cap = self.host_budget or int(avail * (1 - self.headroom))
        disk_free = self.swap.free_bytes() // self.sharing
        swap_cap = self.swap_budget or int(disk_free * (1 - self.headroom))
        bw = self.bandwidths or {}
        disk = bw.get("disk") or {}
        nvme_gbps = min(disk.values()) if disk else None
        levels = []
        if self.shared_host:
            budgets = [b for b in (self.device_budget, self.host_budget) if b]
            cap = min(budgets) if budgets else int(avail * (1 - self.headroom))
            levels.append(Level(0, "host", "cpu", cap, bw.get("device_memory"), {},
                                "host RAM: on a CPU-only run the compute and host levels are the same memory"))
        else:
            dev_cap = self.device_budget or int(_device_free(self.device) * (1 - self.headroom))
            levels.append(Level(0, "device", str(self.device), dev_cap, bw.get("device_memory")))
            link = bw.get("link") or {}
            levels.append(Level(1, "host", "host (pinned)", host_cap, min(link.values()) if link else None, dict(link),
                                "reached over the host<->device link"))
        probe_note = (bw.get("disk_probe") or {}).get("note", "")
        levels.append(Level(len(levels), "nvme", f"nvme:{self.swap.folder}", swap_cap, nvme_gbps, dict(disk),
                            probe_note))
        self.levels = levels

    def measure(self, refresh: bool = False) -> dict:
        """Measure (or re-read from the per-process cache) every level's bandwidth."""
        from apt_model.memory.bandwidth import measure_bandwidths

        self.bandwidths = measure_bandwidths(self.device, self.swap.folder, refresh=refresh)
        self._build()
        return self.bandwidths

    def __str__(self) -> str:
        return "\n".join(str(level) for level in self.levels)

    def describe(self) -> dict:
        return {"device": str(self.device), "shared_host": self.shared_host, "aligned_pages": self.aligned_pages,
                "sharing": self.sharing,
                "levels": [asdict(level) for level in self.levels], "bandwidths": self.bandwidths,
                "swap_folder": str(self.swap.folder),
                "stale_folders_removed": [str(p) for p in self.swap.stale_removed], "warnings": list(self.warnings)}

    def summary_lines(self) -> list[str]:
        return [f"{lv.kind:<6} {format_size(lv.capacity):>10}  {lv.device}" for lv in self.levels]

    def close(self) -> None:
        """Delete the swap folder."""
        self.swap.close()


def create_vgpu_stack(config: dict | None = None) -> VGPUStack:
    """Build the VGPU stack (seed-era API).

    Args:
        config: optional dict with ``device`` (default: the ranking policy's choice),
            ``device_budget``, ``host_budget``, ``swap_dir``, ``swap_budget`` (bytes or strings such
            as ``"4GiB"``), ``headroom`` (fraction, default 0.1), ``measure`` (default True).

    Returns:
        A :class:`VGPUStack`; ``print(stack)`` gives one line per level, e.g.
        ``Level 0: cuda:0 - 71000MB @ 2900.0GB/s``.

    Raises:
        ConfigError: unknown config keys, malformed sizes, or an unusable swap dir.
    """
    from apt_model.base.errors import ConfigError

    cfg = dict(config or {})
    allowed = {"device", "device_budget", "host_budget", "swap_dir", "swap_budget", "headroom", "measure"}
    unknown = set(cfg) - allowed
    if unknown:
        raise ConfigError(f"create_vgpu_stack: unknown config keys {sorted(unknown)}; valid keys: {sorted(allowed)}")
    device = cfg.pop("device", None)
    if device is None:
        from apt_model.devices.ranking import select_device

        device = select_device().device
    return VGPUStack(device, **cfg)
