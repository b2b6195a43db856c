# One image for every role: `specdec serve orchestrator|draft|target`, `specdec autoscale`, ...
#
#   docker build -t specdec:0.1.0 .                                              # CPU torch (default)
#   docker build --build-arg TORCH_VARIANT=cu128 -t specdec:0.1.0-cu128 .        # CUDA 12.8 torch
#
# TORCH_VARIANT names a wheel index of download.pytorch.org (cpu, cu126, cu128, ...: use one that
# has torch 2.13.0); TORCH_INDEX overrides the whole URL (a mirror). The image holds no model:
# models are mounted at /models (deploy/), and the HF libraries are told never to download.
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/${TORCH_VARIANT}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    # Never reach a model hub: a missing model is an error at start-up, not a download.
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    # Caches in /tmp, the one writable place when the root filesystem is read-only (deploy/).
    HF_HOME=/tmp/hf \
    XDG_CACHE_HOME=/tmp/cache

# torch first, from the chosen index, in a layer of its own (the big one, rebuilt only when the
# variant changes). `pip install .[server]` below then finds torch==2.13.0 satisfied (2.13.0+cpu is 2.13.0).
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY specdec/ specdec/
COPY core/ core/
COPY services/ services/
COPY orchestrator/ orchestrator/
# The server extra: every role runs from this image (plain `specdec` is the client only).
RUN pip install ".[server]" && rm -rf /src

# A fixed non-root uid/gid, the one the manifests' securityContext names (runAsUser: 10001).
RUN groupadd --system --gid 10001 specdec \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/specdec --create-home --shell /usr/sbin/nologin specdec \
    && mkdir -p /models
USER 10001:10001
WORKDIR /home/specdec

# Mount point for the models (target/ and draft/ folders saved with save_pretrained), read-only.
VOLUME ["/models"]
# Client API, draft, target (gRPC); Prometheus metrics.
EXPOSE 50051 50052 50053 9400

ENTRYPOINT ["specdec"]
CMD ["--help"]
