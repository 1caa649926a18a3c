"""The C++ CPU kernels: paged decode attention, GGUF block decoding, bfloat16 dot products."""
