"""Mixed precision applied by the switch: autocast around an adopted model's forward."""
from apt_model.precision.autocast import AutocastHooks, attach_autocast

__all__ = ["AutocastHooks", "attach_autocast"]
