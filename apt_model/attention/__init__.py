"""Attention: the project's causal self-attention (eager or SDPA) and routing of a model's
attention through fused SDPA (:mod:`apt_model.attention.routing`)."""
from apt_model.attention.causal import CausalSelfAttention
from apt_model.attention.routing import AttentionTarget, find_attention_targets, route_to_sdpa

__all__ = ["AttentionTarget", "CausalSelfAttention", "find_attention_targets", "route_to_sdpa"]
