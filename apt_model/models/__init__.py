"""Models shipped with apt_model: a GPT-style byte-level decoder for the main job and tests."""
from apt_model.models.gpt import GPT, GPTConfig, PRESETS

__all__ = ["GPT", "GPTConfig", "PRESETS"]
