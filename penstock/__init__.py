"""Penstock: an OpenAI-compatible inference gateway and admin API."""

__version__ = "0.1.0"
