# One image for every role: `specdec serve orchestrator|draft|target`, `specdec autoscale`, ...
#
#   docker build -t specdec:0.1.0 .                                              # CPU torch (default)
#   docker build -t REGISTRY/specdec:0.1.0-cu128 \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .          # CUDA 12.8 torch
#
# BASE_IMAGE: any Debian or Ubuntu image; one without python3 (the nvidia/cuda images) gets its
# distribution's (Ubuntu 24.04: Python 3.12, which specdec supports). specdec runs from a virtual
# environment in /opt/venv either way. TORCH_INDEX: a wheel index of download.pytorch.org (whl/cpu,
# whl/cu126, whl/cu128, ...) or a mirror; TORCH_VARIANT=cu128 is the short form of the line above.
# TORCH_SPEC: the torch requirement taken from that index (pyproject.toml admits any torch >= 2.11;
# pick a version the index has for the base image's Python). A CUDA build of torch carries its own
# CUDA libraries: the base image only has to match the node's driver (the NVIDIA container toolkit
# mounts the driver in). The image holds no model: models are mounted at /models (deploy/), and
# the HF libraries are told never to download.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/${TORCH_VARIANT}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    # Never reach a model hub: a missing model is an error at start-up, not a download.
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    # Caches in /tmp, the one writable place when the root filesystem is read-only (deploy/).
    HF_HOME=/tmp/hf \
    XDG_CACHE_HOME=/tmp/cache

# Python where the base image has none (nvidia/cuda), then a virtual environment: a distribution's
# own Python refuses pip installs into it (PEP 668), and one layout serves both kinds of base.
RUN if ! command -v python3 >/dev/null 2>&1 || ! python3 -c "import venv, ensurepip" >/dev/null 2>&1; then \
        apt-get update -qq \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3 python3-venv ca-certificates \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv

# torch first, from the chosen index, in a layer of its own (the big one, rebuilt only when the
# index or the spec changes). `pip install .[server]` below then finds torch>=2.11 satisfied and
# keeps this build (CPU or CUDA).
RUN pip install "${TORCH_SPEC}" --index-url "${TORCH_INDEX}"

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
