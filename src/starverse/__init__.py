"""Starverse: plan, run and account for training large models on mixed rented accelerators."""

from __future__ import annotations

__version__ = "0.1.0"
