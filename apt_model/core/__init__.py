"""Seed-era ``apt_model.core`` path: :mod:`apt_model.core.system`."""
