"""Mamba-2 models and hybrids of attention and Mamba-2 layers: Mamba2, Bamba, Granite 4.0-H
(GraniteMoeHybrid), Nemotron-H and Falcon-H1."""

from __future__ import annotations
