# Local stand-ins for the public images docker-compose.yml names (flwr/superlink, flwr/supernode,
# flwr/superexec, nginx), for hosts that cannot pull them. Built by docker/standins/build.sh from a
# debootstrap'ed Debian base; each stand-in keeps what the compose file and docker/app.Dockerfile
# rely on in the official image: its entrypoint, the non-root user `app` (uid 49999, home /app),
# the virtual environment in /python/venv on PATH and owned by `app` (so `pip install` works as
# that user), and Flower at the image tag's version.
ARG BASE_IMAGE=fibos-fl/debian-base:bookworm
# hadolint ignore=DL3006
FROM ${BASE_IMAGE} AS flower

ARG FLWR_VERSION=1.42.0
# grpcio-health-checking: its newest releases need protobuf 7, which flwr excludes; the pin spares
# pip a long backtrack (the package itself is what the compose health checks import).
ARG HEALTH_PIN="grpcio-health-checking<1.82"

ENV PATH=/python/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    LANG=C.UTF-8 \
    LC_ALL=C.UTF-8 \
    HOME=/app

RUN useradd --no-create-home --home-dir /app -c "" --uid 49999 --user-group app \
    && mkdir -p /app /python \
    && python3 -m venv /python/venv \
    && /python/venv/bin/python -m pip install --no-cache-dir --disable-pip-version-check \
        "flwr==${FLWR_VERSION}" "${HEALTH_PIN}" \
    && chown -R app:app /app /python
USER 49999:49999
WORKDIR /app

FROM flower AS superlink
ENTRYPOINT ["flower-superlink"]

FROM flower AS supernode
ENTRYPOINT ["flower-supernode"]

FROM flower AS superexec
ENTRYPOINT ["flower-superexec"]

# hadolint ignore=DL3006
FROM ${BASE_IMAGE} AS nginx
# Debian's nginx-light; wget for the gateway's health check (the official image has busybox wget).
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nginx-light wget \
    && rm -rf /var/lib/apt/lists/* \
    && ln -sf /dev/stdout /var/log/nginx/access.log \
    && ln -sf /dev/stderr /var/log/nginx/error.log \
    && printf '#!/bin/sh\nexec "$@"\n' > /docker-entrypoint.sh \
    && chmod 0755 /docker-entrypoint.sh
STOPSIGNAL SIGQUIT
ENTRYPOINT ["/docker-entrypoint.sh"]
CMD ["nginx", "-g", "daemon off;"]
