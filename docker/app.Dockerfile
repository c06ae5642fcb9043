# fibos-fl: the ServerApp executor, the ClientApp executors and the one-shot control services
# (credentials, registration, run submission) of docker-compose.yml.
#
# Multi-arch: the same file builds for x86 servers and ARM boards, e.g.
#   docker buildx build --platform linux/amd64,linux/arm64 -f docker/app.Dockerfile -t fibos-fl/app:cpu .
#
# The GPU executor is this file with torch from PyPI: PyPI's Linux x86_64 wheel carries the CUDA runtime
# libraries itself, so the host needs only the NVIDIA driver and the NVIDIA Container Toolkit, and no
# NVIDIA base image is pulled (docker/app-cuda-nvidia.Dockerfile is the alternative on NVIDIA's base):
#   docker build -f docker/app.Dockerfile --build-arg TORCH_INDEX= --build-arg REQUIRE_CUDA=1 -t fibos-fl/app:cuda .
# Built on Flower's official SuperExec image (non-root user `app`, uid 49999, venv in /python/venv).
ARG FLWR_IMAGE=flwr/superexec:1.42.0-py3.13-ubuntu24.04
FROM ${FLWR_IMAGE}

# CPU wheels of torch from PyTorch's index: the PyPI x86 wheel bundles CUDA (gigabytes unused on a CPU).
# Empty = pip's default index (where PyTorch's is out of reach; on x86 that is the CUDA 13 build, which
# needs an NVIDIA driver of the 580 series or later; an older driver takes PyTorch's index of its CUDA
# release, e.g. https://download.pytorch.org/whl/cu128).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.14.1
ARG TORCHVISION_VERSION=0.29.1

ENV FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FIBOS_CACHE_DIR=/app/.cache/fibos-fl

USER 0
# Mount points of the compose volumes, owned by the image user so fresh named volumes are too.
RUN mkdir -p /credentials /results /state /app/.cache /app/.fibos-fl \
    && chown -R app:app /credentials /results /state /app
USER 49999:49999
WORKDIR /app

# Largest and slowest-changing layer first. (DL3013: hadolint reads the optional --index-url as a package.)
# hadolint ignore=DL3013
RUN python -m pip install --no-cache-dir ${TORCH_INDEX:+--index-url "${TORCH_INDEX}"} \
    "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}"

# 1 = the GPU image: the build fails unless the torch installed is a CUDA build. Declared after the
# torch layer, so the CPU and GPU images share it when their index is the same.
ARG REQUIRE_CUDA=0
RUN if [ "${REQUIRE_CUDA}" = 1 ]; then \
        python -c "import sys, torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda); sys.exit(torch.version.cuda is None)"; \
    fi

# The project's dependencies, without its code (empty packages), so code edits reuse this layer.
COPY --chown=app:app pyproject.toml README.md ./
RUN mkdir -p server client common \
    && touch server/__init__.py client/__init__.py common/__init__.py \
    && python -m pip install --no-cache-dir . \
    && python -m pip uninstall -y fibos-fl

COPY --chown=app:app common common
COPY --chown=app:app client client
COPY --chown=app:app server server
COPY --chown=app:app cli cli
RUN python -m pip install --no-cache-dir --no-deps . \
    && python -c "import server.app, client.app, cli.control; from sklearn.datasets import load_digits; load_digits()"

ENTRYPOINT ["flower-superexec"]
