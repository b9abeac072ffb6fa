"""Kimi Linear: Kimi Delta Attention (the delta rule with a per-channel forget gate) beside
multi-head latent attention."""

from __future__ import annotations
