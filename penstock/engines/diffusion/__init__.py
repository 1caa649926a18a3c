"""The ``diffusion`` engine: video and image generation on diffusers pipelines."""

from penstock.engines.diffusion.engine import DiffusersEngine

__all__ = ["DiffusersEngine"]
