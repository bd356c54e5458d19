"""The one ranking policy: which device a run uses, and why.

Device choice, the communication backend and every report go through :func:`select_device`,
so they can never disagree. The order is the backends' ``priority`` (CUDA/ROCm/DCU > NPU >
MLU > XPU > MPS > CPU), changed only by an explicit preference (``prefer=("npu",)``,
``prefer_npu=True``) or an explicit device (``device=`` argument, then the ``VB_DEVICE``
environment variable). Under a launcher (torchrun's ``LOCAL_RANK``), a device chosen without an
index is this rank's local device (:mod:`apt_model.devices.binding`). An explicit device that is not usable is an error that says why — never
a silent fall-back to the CPU.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

import torch

from apt_model.devices.detection import Candidate, detect_devices
from apt_model.devices.binding import bind_for_launcher
from apt_model.base.errors import ConfigError, DeviceSelectionError
from apt_model.base.settings import read_env
from apt_model.devices.settings import DEVICE

_SPEC = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?::\s*(\d+))?\s*$")


@dataclass(frozen=True)
class Selection:
    """The chosen device and how it was chosen.

    Attributes:
        device: the torch device, always with an index for accelerators (``npu:0``, never a bare int).
        candidate: the detected kind it belongs to.
        source: ``argument``, ``VB_DEVICE``, ``force_cpu`` or ``ranking``.
        reason: one sentence for reports.
        ranking: kinds of the available candidates, best first, under the preference in force.
    """

    device: torch.device
    candidate: Candidate
    source: str
    reason: str
    ranking: tuple[str, ...] = field(default=())

    @property
    def kind(self) -> str:
        return self.candidate.kind

    def to_dict(self) -> dict:
        return {
            "device": str(self.device),
            "kind": self.kind,
            "source": self.source,
            "reason": self.reason,
            "ranking": list(self.ranking),
            "dist_backend": self.candidate.dist_backend,
        }


def candidate_names(c: Candidate) -> set[str]:
    """Every name that addresses candidate ``c``: its detected kind, its torch device type, and
    its backend's class kind and refined kinds (``rocm`` and ``dcu`` whichever was detected)."""
    names = {c.kind, c.device_type}
    if c.backend is not None:
        names |= {type(c.backend).kind, *type(c.backend).refined_kinds} - {""}
    return names


def _known_names(candidates: list[Candidate]) -> list[str]:
    return sorted(set().union(*(candidate_names(c) for c in candidates)))


def normalize_prefer(prefer: str | Iterable[str] | None, candidates: list[Candidate]) -> tuple[str, ...]:
    """Validate a preference (a kind or device type, or a sequence of them) and return it as a tuple.

    Raises:
        ConfigError: for a name that is neither a registered kind nor a device type.
    """
    if prefer is None:
        return ()
    items = (prefer,) if isinstance(prefer, str) else tuple(prefer)
    known = _known_names(candidates)
    folded = {name.lower(): name for name in known}  # "CUDA" as "cuda", as every other choice folds case
    out = []
    for p in items:
        name = folded.get(p.strip().lower()) if isinstance(p, str) else None
        if name is None:
            raise ConfigError(f"prefer={p!r} is not a device kind; valid: {', '.join(known)}")
        out.append(name)
    return tuple(out)


def rank(candidates: list[Candidate], prefer: tuple[str, ...] = ()) -> list[Candidate]:
    """Available candidates, best first: preferred kinds in the order given, then by priority."""

    def key(c: Candidate):
        for i, p in enumerate(prefer):
            if p in candidate_names(c):
                return (i, c.priority, c.kind)
        return (len(prefer), c.priority, c.kind)

    return sorted((c for c in candidates if c.available), key=key)


def parse_device_spec(spec: str | torch.device, candidates: list[Candidate] | None = None,
                      label: str = "device") -> tuple[str, int | None]:
    """Parse ``"npu:1"``, ``"cpu"``, ``"cuda"`` or a ``torch.device`` into ``(kind_or_type, index)``.

    ``label`` is how messages name what the user wrote (``device``, ``VB_DEVICE``, ``--device``).

    Raises:
        ConfigError: for a malformed string or a name that is no known kind or device type.
    """
    candidates = detect_devices() if candidates is None else candidates
    if isinstance(spec, torch.device):
        name, index = spec.type, spec.index
    else:
        m = _SPEC.match(str(spec))
        if not m:
            raise ConfigError(f"{label}={str(spec)!r} is malformed; write KIND or KIND:INDEX, e.g. 'cpu', 'cuda:0', 'npu:1'")
        name, index = m.group(1).lower(), (int(m.group(2)) if m.group(2) is not None else None)
    known = _known_names(candidates)
    if name not in known:
        raise ConfigError(f"{label}={str(spec)!r}: unknown kind {name!r}; valid kinds: {', '.join(known)}")
    return name, index


def _resolve(spec: str | torch.device, candidates: list[Candidate], label: str, source: str, order: tuple[str, ...]) -> Selection:
    name, index = parse_device_spec(spec, candidates, label)
    matching = [c for c in candidates if name in candidate_names(c)]
    usable = [c for c in matching if c.available]
    if not usable:
        why = "; ".join(f"{c.kind}: {c.status} - {c.reason}" for c in matching)
        raise DeviceSelectionError(f"{label}={str(spec)!r} asks for {name}, which is not usable here ({why})")
    cand = min(usable, key=lambda c: c.priority)
    if cand.device_type == "cpu":
        # torch takes "cpu:3" for the one CPU device (a script may write f"{kind}:{local_rank}" for
        # every kind): so does the switch, and the reason says so
        note = f" ({str(spec)!r}: the CPU is one device, as torch takes it)" if index not in (None, 0) else ""
        return Selection(torch.device("cpu"), cand, source, f"{label} asked for the CPU{note}", order)
    note = ""
    if index is None:  # under a launcher, a kind without an index means this rank's device
        bound = bind_for_launcher(cand)
        index, note = bound if bound is not None else (0, "")
    if index >= cand.count:
        raise DeviceSelectionError(
            f"{label}={str(spec)!r}: {cand.kind} has {cand.count} device(s), valid indices 0..{cand.count - 1}"
        )
    why = f"{label} asked for {cand.kind}" + (f"; {note}" if note else f":{index}")
    return Selection(torch.device(cand.device_type, index), cand, source, why, order)


def select_device(
    prefer: str | Iterable[str] | None = None,
    device: str | torch.device | None = None,
    force_cpu: bool = False,
    candidates: list[Candidate] | None = None,
    label: str = "device",
) -> Selection:
    """Choose the device for this process.

    Precedence: ``force_cpu`` > ``device`` argument > ``VB_DEVICE`` environment variable >
    ranking (``prefer`` first, then priority). ``"auto"`` (argument or variable) means the ranking.
    ``label`` names the ``device`` argument in messages (an entry point passes its flag, ``--device``). Under a launcher that sets ``LOCAL_RANK``, an
    accelerator chosen without an index is the rank's local device (see
    :func:`apt_model.devices.binding.local_device_index`); an explicit index is kept.

    Raises:
        ConfigError: malformed device string or unknown kind in ``device``/``VB_DEVICE``/``prefer``,
            or malformed launcher variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``...).
        DeviceSelectionError: the explicitly requested device is not usable, or, under a launcher,
            fewer devices of the chosen kind are visible than there are local ranks (every rank
            raises, before any collective: see :func:`apt_model.devices.binding.local_device_index`);
            the message carries the reason and the fixes.
    """
    candidates = detect_devices() if candidates is None else candidates
    prefer_t = normalize_prefer(prefer, candidates)
    ranked = rank(candidates, prefer_t)
    order = tuple(c.kind for c in ranked)
    if force_cpu:
        cpu = next(c for c in candidates if c.device_type == "cpu")
        return Selection(torch.device("cpu"), cpu, "force_cpu", "force_cpu=True", order)
    if device is not None and str(device).strip().lower() not in ("", "auto"):  # "auto": the ranking's choice
        return _resolve(device, candidates, label, "argument", order)
    found = read_env(DEVICE)  # validated: malformed or unknown kinds raise ConfigError naming VB_DEVICE
    if found is not None and found[0] != "auto":
        return _resolve(found[0], candidates, DEVICE.env, DEVICE.env, order)
    best = ranked[0]
    skipped = [f"{c.kind} ({c.status})" for c in candidates if not c.available and c.priority < best.priority]
    why = f"best available by ranking {' > '.join(order)}"
    if prefer_t:
        why += f" with preference for {', '.join(prefer_t)}"
    if skipped:
        why += f"; ranked higher but not usable: {', '.join(skipped)}"
    bound = bind_for_launcher(best)
    if bound is not None:
        why += f"; {bound[1]}"
    dev = torch.device("cpu") if best.device_type == "cpu" else torch.device(best.device_type, bound[0] if bound else 0)
    return Selection(dev, best, "ranking", why, order)
