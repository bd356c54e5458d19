"""Mixed precision applied by the switch: autocast around an adopted model's forward, confirmed
by an on-line speed trial on the model itself."""
from apt_model.precision.autocast import AutocastHooks, attach_autocast
from apt_model.devices.trial import SpeedTrial

__all__ = ["AutocastHooks", "SpeedTrial", "attach_autocast"]
