"""The engine core: requests and their sequences, the scheduler and its step loop, the KV
blocks and their arena, prefill planning and chunk pacing, the model runner and sampling."""
