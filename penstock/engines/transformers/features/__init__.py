"""Model features over the core: LoRA adapters, image inputs, structured outputs, batch-
invariant logprobs and the experts a mixture-of-experts model routes to."""
