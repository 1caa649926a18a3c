"""Weights: loading a checkpoint, the CPU and GGUF weight formats, pushes into the live
model, and the weight controls."""
