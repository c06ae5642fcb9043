# fibos-fl ClientApp executor for NVIDIA GPU nodes on NVIDIA's CUDA base image (linux/amd64; needs the
# NVIDIA driver and the NVIDIA Container Toolkit on the host): the alternative to the default GPU image,
# docker/app.Dockerfile with PyPI's CUDA torch, for sites that mirror NVIDIA's registry or need its base.
# It installs Python, CUDA torch from PyTorch's index of the base's CUDA release, Flower and the project.
#   docker build -f docker/app-cuda-nvidia.Dockerfile -t fibos-fl/app:cuda .
#   (docker-compose.yml: FIBOS_CUDA_DOCKERFILE=docker/app-cuda-nvidia.Dockerfile
#    FIBOS_CUDA_TORCH_INDEX=https://download.pytorch.org/whl/cu130)
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-base-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cu130
ARG TORCH_VERSION=2.14.1
ARG TORCHVISION_VERSION=0.29.1
ARG FLWR_VERSION=1.42.0

ENV DEBIAN_FRONTEND=noninteractive \
    PATH=/python/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LANG=C.UTF-8 \
    LC_ALL=C.UTF-8 \
    HOME=/app \
    FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FIBOS_CACHE_DIR=/app/.cache/fibos-fl

# Same user and layout as Flower's images (uid 49999, venv in /python/venv), so volumes are shared.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get -y --no-install-recommends install python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --no-create-home --home-dir /app -c "" --uid 49999 app \
    && mkdir -p /app/.cache /app/.fibos-fl /credentials /results /state /python \
    && chown -R app:app /app /credentials /results /state /python
USER 49999:49999
WORKDIR /app
# DL3013: hadolint reads the optional --index-url as a package.
# hadolint ignore=DL3013
RUN python3 -m venv /python/venv \
    && python -m pip install --no-cache-dir ${TORCH_INDEX:+--index-url "${TORCH_INDEX}"} \
    "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}"

COPY --chown=app:app pyproject.toml README.md ./
RUN mkdir -p server client common \
    && touch server/__init__.py client/__init__.py common/__init__.py \
    && python -m pip install --no-cache-dir "flwr==${FLWR_VERSION}" . \
    && python -m pip uninstall -y fibos-fl

COPY --chown=app:app common common
COPY --chown=app:app client client
COPY --chown=app:app server server
COPY --chown=app:app cli cli
RUN python -m pip install --no-cache-dir --no-deps . \
    && python -c "import server.app, client.app, cli.control"

ENTRYPOINT ["flower-superexec"]
