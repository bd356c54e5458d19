"""The launcher's environment: rank, local rank, world size and rendezvous address of this process.

``torchrun`` (``python -m torch.distributed.run``, which ``accelerate launch`` also uses) and
other launchers (SLURM or MPI wrappers that export the same variables) start one process per device and describe it through environment variables:

=================== ========================================================================
``RANK``            this process's rank among all processes (0 .. WORLD_SIZE-1)
``LOCAL_RANK``      its rank among the processes on this node (selects the local device)
``WORLD_SIZE``      the number of processes in the job
``LOCAL_WORLD_SIZE`` processes on this node (set by torchrun; optional)
``MASTER_ADDR``     host of the rendezvous store (rank 0's node)
``MASTER_PORT``     its port
=================== ========================================================================

:func:`read_launch_env` reads them once, validates them, and says what is missing. Nothing here
imports ``torch.distributed`` or touches a device.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping

from apt_model.base.errors import ConfigError

#: Variables a launcher sets, in the order reports list them.
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: What ``init_process_group(init_method="env://")`` needs, besides LOCAL_RANK for the device.
REQUIRED_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

#: Variables that identify the launcher, checked in order (only used to name it in reports).
_LAUNCHER_MARKERS = (
    ("TORCHELASTIC_RUN_ID", "torchrun"),
    ("OMPI_COMM_WORLD_SIZE", "mpirun (Open MPI)"),
    ("PMI_SIZE", "mpirun (MPICH/PMI)"),
    ("SLURM_PROCID", "slurm"),
)


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in a multi-process job, as the launcher described it.

    Attributes:
        rank: global rank, or None when ``RANK`` is unset.
        local_rank: rank on this node, or None when ``LOCAL_RANK`` is unset.
        world_size: number of processes, or None when ``WORLD_SIZE`` is unset.
        local_world_size: processes on this node (``LOCAL_WORLD_SIZE``), or None.
        master_addr / master_port: the rendezvous address, or None.
        launcher: ``torchrun``, ``slurm``, ... or ``environment`` when no launcher marker is set.
        missing: variables of :data:`REQUIRED_VARS` that are unset.
        variables: the launcher variables as found (names to raw strings), for reports.
    """

    rank: int | None
    local_rank: int | None
    world_size: int | None
    local_world_size: int | None
    master_addr: str | None
    master_port: int | None
    launcher: str
    missing: tuple[str, ...] = ()
    variables: dict = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        """Every variable ``init_process_group(init_method="env://")`` and device binding need is set."""
        return not self.missing

    @property
    def multi_process(self) -> bool:
        """More than one process in the job (``WORLD_SIZE > 1``)."""
        return (self.world_size or 1) > 1

    @property
    def master(self) -> str | None:
        """``host:port`` of the rendezvous store, or None."""
        if self.master_addr is None:
            return None
        return f"{self.master_addr}:{self.master_port}" if self.master_port is not None else self.master_addr

    def describe(self) -> str:
        """One line for reports: ``torchrun: rank 1 of 2 (local rank 1), rendezvous 127.0.0.1:29500``."""
        text = f"{self.launcher}: rank {self.rank} of {self.world_size}"
        if self.local_rank is not None:
            text += f" (local rank {self.local_rank}"
            text += f" of {self.local_world_size})" if self.local_world_size is not None else ")"
        if self.master:
            text += f", rendezvous {self.master}"
        if self.missing:
            text += f"; missing {', '.join(self.missing)}"
        return text

    def to_dict(self) -> dict:
        return {"launcher": self.launcher, "rank": self.rank, "local_rank": self.local_rank,
                "world_size": self.world_size, "local_world_size": self.local_world_size,
                "master": self.master, "missing": list(self.missing), "variables": dict(self.variables)}


def _int(environ: Mapping[str, str], name: str, minimum: int) -> int | None:
    raw = environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer; a launcher such as torchrun sets {name} "
                          f"to an integer >= {minimum}") from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} must be >= {minimum}")
    return value


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """Read the launcher variables of this process.

    Args:
        environ: the environment to read (default ``os.environ``).

    Returns:
        None when ``WORLD_SIZE`` is unset (no launcher: a single process as far as the switch is
        concerned), else a :class:`LaunchEnv`; ``missing`` lists required variables that are unset.

    Raises:
        ConfigError: a variable is not an integer where one is required (``RANK``, ``LOCAL_RANK``,
            ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_PORT``), is negative, ``WORLD_SIZE`` is 0,
            or ``RANK`` / ``LOCAL_RANK`` is not below ``WORLD_SIZE`` / ``LOCAL_WORLD_SIZE``.
    """
    env = os.environ if environ is None else environ
    if not (env.get("WORLD_SIZE") or "").strip():
        return None
    world = _int(env, "WORLD_SIZE", 1)
    rank = _int(env, "RANK", 0)
    local_rank = _int(env, "LOCAL_RANK", 0)
    local_world = _int(env, "LOCAL_WORLD_SIZE", 1)
    port = _int(env, "MASTER_PORT", 0)
    if port is not None and port > 65535:
        raise ConfigError(f"MASTER_PORT={env['MASTER_PORT']!r} is not a port number (0..65535)")
    if rank is not None and rank >= world:
        raise ConfigError(f"RANK={rank} is not below WORLD_SIZE={world}; valid ranks: 0..{world - 1}")
    if local_rank is not None and local_world is not None and local_rank >= local_world:
        raise ConfigError(f"LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world}; "
                          f"valid local ranks: 0..{local_world - 1}")
    addr = (env.get("MASTER_ADDR") or "").strip() or None
    launcher = next((name for var, name in _LAUNCHER_MARKERS if env.get(var)), "environment")
    missing = tuple(v for v in REQUIRED_VARS if not (env.get(v) or "").strip())
    found = {v: env[v] for v in LAUNCH_VARS if env.get(v) is not None}
    return LaunchEnv(rank, local_rank, world, local_world, addr, port, launcher, missing, found)


def process_rank() -> tuple[int, int]:
    """``(rank, world_size)`` of this process: from the default process group when it is
    initialized, else from the launcher's variables, else ``(0, 1)``.

    Scripts use it to let only rank 0 write files or print, and to give each rank its own data.

    Raises:
        ConfigError: malformed launcher variables (see :func:`read_launch_env`).
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
    except ImportError:  # pragma: no cover - every supported torch build has torch.distributed
        pass
    env = read_launch_env()
    if env is None or env.rank is None:
        return 0, 1
    return env.rank, env.world_size or 1
