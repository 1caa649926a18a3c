"""Weight updates shared by the engines and the trainer helper: the push formats, the
process group, the NIXL pull, the checksum, and tensor payloads."""
