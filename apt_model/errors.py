"""The public path of apt_model's error types (defined in :mod:`apt_model.base.errors`).

Scripts catch these by ``from apt_model.errors import ConfigError``; the paging errors raised
while training (``SwapFullError``...) are imported from their modules, each a :class:`VBError`
(docs/troubleshooting.md, "Paging").
"""
from apt_model.base.errors import *  # noqa: F401,F403
from apt_model.base.errors import __all__  # noqa: F401
