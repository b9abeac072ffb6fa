"""Hybrids of attention and Gated DeltaNet (linear attention with the gated delta rule):
Qwen3-Next, Qwen3.5 (dense and MoE, text part) and OLMo Hybrid."""

from __future__ import annotations
