"""The seed-era public import paths (``vb_global``, ``npu_backend``); the implementations live in
:mod:`apt_model.switch` and :mod:`apt_model.devices`."""
