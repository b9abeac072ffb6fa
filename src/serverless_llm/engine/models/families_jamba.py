"""Jamba: attention beside Mamba (Mamba-1) layers, with mixture-of-experts MLPs."""

from __future__ import annotations
