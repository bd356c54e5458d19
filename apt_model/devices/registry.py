"""Registration of device kinds: the ``@register_backend`` decorator and the entry-point group.

Built-in kinds register themselves when :mod:`apt_model.devices.backends` is imported. Third
parties add a kind either by decorating their :class:`~apt_model.devices.backend.AcceleratorBackend`
subclass with :func:`register_backend`, or by declaring an entry point in the group
``apt_model.backends`` that points at the class (loaded on first detection).
"""
from __future__ import annotations

from importlib.metadata import entry_points

from apt_model.devices.backend import AcceleratorBackend
from apt_model.devices.plugins import describe_exception
from apt_model.base.errors import ConfigError
from apt_model.base.log import get_logger

log = get_logger(__name__)

ENTRY_POINT_GROUP = "apt_model.backends"
_REGISTRY: dict[str, type[AcceleratorBackend]] = {}
#: Entry points that failed to load: ``{entry_point_name: error_text}``.
ENTRY_POINT_ERRORS: dict[str, str] = {}
_entry_points_loaded = False


def register_backend(cls: type[AcceleratorBackend] | None = None, *, replace: bool = False):
    """Register a device kind. Usable as ``@register_backend`` or ``@register_backend(replace=True)``.

    Raises:
        ConfigError: when the class is not an AcceleratorBackend subclass, lacks ``kind`` or
            ``device_type``, or its kind is already registered and ``replace`` is false.
    """

    def _register(klass: type[AcceleratorBackend]) -> type[AcceleratorBackend]:
        if not (isinstance(klass, type) and issubclass(klass, AcceleratorBackend)):
            raise ConfigError(f"{klass!r} is not a subclass of AcceleratorBackend")
        if not klass.kind or not klass.device_type:
            raise ConfigError(f"{klass.__name__} must set the class attributes 'kind' and 'device_type'")
        if klass.kind in _REGISTRY and not replace and _REGISTRY[klass.kind] is not klass:
            raise ConfigError(
                f"device kind {klass.kind!r} is already registered by {_REGISTRY[klass.kind].__name__}; "
                "pass replace=True to override it"
            )
        _REGISTRY[klass.kind] = klass
        return klass

    return _register(cls) if cls is not None else _register


def unregister_backend(kind: str) -> None:
    """Remove a registered kind (mainly for tests). Raises ConfigError for an unknown kind."""
    if kind not in _REGISTRY:
        raise ConfigError(f"device kind {kind!r} is not registered; registered: {', '.join(sorted(_REGISTRY))}")
    del _REGISTRY[kind]


def load_entry_point_backends() -> None:
    """Load backends declared in the ``apt_model.backends`` entry-point group (once per process).

    A failing entry point is logged and recorded in :data:`ENTRY_POINT_ERRORS`; it never raises.
    """
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            register_backend(ep.load())
        except Exception as err:  # noqa: BLE001 - a broken third-party backend must not crash us
            ENTRY_POINT_ERRORS[ep.name] = describe_exception(err)
            log.warning("device backend entry point %r failed: %s", ep.name, ENTRY_POINT_ERRORS[ep.name])


def registered_backends() -> list[AcceleratorBackend]:
    """One instance of every registered kind, in ranking-priority order."""
    import apt_model.devices.backends  # noqa: F401 - registers the built-in kinds

    load_entry_point_backends()
    return [cls() for cls in sorted(_REGISTRY.values(), key=lambda c: (c.priority, c.kind))]


def backend_class(kind: str) -> type[AcceleratorBackend]:
    """The registered class for ``kind``. Raises ConfigError naming the registered kinds."""
    import apt_model.devices.backends  # noqa: F401

    load_entry_point_backends()
    if kind not in _REGISTRY:
        raise ConfigError(f"unknown device kind {kind!r}; registered kinds: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[kind]
