#!/usr/bin/env bash
# The Docker end-to-end test from nothing (what `make test-docker` runs): installs a Docker
# engine and Compose v2 where missing, starts the engine if none answers (and stops it again at
# the end), builds local stand-ins for the public images this host cannot pull, then runs
#
#   docker/e2e.sh PYTHON -m pytest ... tests/test_docker_compose.py
#
# with FIBOS_DOCKER_TEST=1, so the test fails (never skips) when the engine cannot be had.
# Needs root to install and start the engine; with an engine already running, the docker
# group is enough. Each phase's wall time is printed.
#
# Environment:
#   FIBOS_BUILD_NETWORK  network of the app image's build (default here: host; on hosts whose
#                        bridge network reaches the package index, `default` works too)
#   FIBOS_TORCH_INDEX    torch's package index for the app image (default here: empty, i.e.
#                        pip's default index, as PyTorch's own CPU index may be out of reach)
#   FIBOS_STANDINS       1 (default) builds stand-ins for flwr/* and nginx images that are not
#                        present; 0 uses what the engine has or can pull
#   FIBOS_DOCKER_ARM64   1 also builds arm64 stand-ins (QEMU emulation) for the arm64 test
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$#" -ge 1 ] || { sed -n '2,19p' "$0"; exit 2; }

STATE=/run/fibos-e2e-dockerd
ENGINE_LOG=/var/log/fibos-e2e-dockerd.log

t_all=$SECONDS
phase_start=$SECONDS
say() { printf '[docker-e2e %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
phase() { say "$1: $((SECONDS - phase_start)) s"; phase_start=$SECONDS; }

start_engine() {
    if docker info >/dev/null 2>&1; then
        say "using the running Docker engine"
        return
    fi
    # What the engine changes in the host's network set-up, to put back when it stops.
    mkdir -p "$STATE"
    sysctl -n net.ipv4.ip_forward >"$STATE/ip_forward"
    (iptables -S FORWARD 2>/dev/null | sed -n 's/^-P FORWARD //p' || true) >"$STATE/forward_policy"
    say "starting dockerd (log: $ENGINE_LOG)"
    dockerd --storage-driver overlay2 --exec-opt native.cgroupdriver=cgroupfs >"$ENGINE_LOG" 2>&1 &
    echo $! >"$STATE/pid"
    for _ in $(seq 1 60); do
        docker info >/dev/null 2>&1 && return
        kill -0 "$(cat "$STATE/pid")" 2>/dev/null || break
        sleep 1
    done
    tail -20 "$ENGINE_LOG" >&2
    echo "the Docker engine did not start" >&2
    return 1
}

# shellcheck disable=SC2317  # run by the EXIT trap
stop_engine() {
    [ -f "$STATE/pid" ] || return 0
    local pid
    pid="$(cat "$STATE/pid")"
    say "stopping the dockerd this script started (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -KILL "$pid" 2>/dev/null || true
    # Docker leaves its bridge, forwarding switched on and the FORWARD policy at DROP: undo them,
    # so tests that route through this host's network namespace see it as before.
    ip link delete docker0 2>/dev/null || true
    sysctl -qw net.ipv4.ip_forward="$(cat "$STATE/ip_forward")" || true
    policy="$(cat "$STATE/forward_policy")"
    [ -z "$policy" ] || iptables -P FORWARD "$policy" 2>/dev/null || true
    rm -rf "$STATE"
}

# A TERM/INT (a CI time limit) still runs the EXIT trap, so a started engine is stopped.
trap 'exit 143' TERM INT
timeout 900 docker/install-engine.sh
phase "engine and Compose installed"
trap stop_engine EXIT
start_engine
phase "engine answering"
if [ "${FIBOS_STANDINS:-1}" = 1 ]; then
    timeout 1800 docker/standins/build.sh
    phase "stand-in images"
    if [ "${FIBOS_DOCKER_ARM64:-0}" = 1 ]; then
        timeout 5400 docker/standins/build.sh --arch arm64 --only "supernode superexec"
        phase "arm64 stand-in images (emulated)"
    fi
fi
export FIBOS_DOCKER_TEST=1
export FIBOS_BUILD_NETWORK="${FIBOS_BUILD_NETWORK-host}"
export FIBOS_TORCH_INDEX="${FIBOS_TORCH_INDEX-}"
rc=0
"$@" || rc=$?
phase "test (app image build + federation runs)"
say "total: $((SECONDS - t_all)) s; image sizes:"
docker image ls --format '  {{.Repository}}:{{.Tag}} {{.Size}}' | grep -E 'fibos-fl/|flwr/|nginx' || true
exit "$rc"
