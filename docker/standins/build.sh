#!/usr/bin/env bash
# Build local stand-ins for the public images docker-compose.yml uses, for a Docker host that
# cannot pull them (an offline or mirror-only host, or CI): flwr/superlink, flwr/supernode and
# flwr/superexec at exactly the names and tags the compose file and docker/app.Dockerfile name,
# and the nginx image of the Fleet gateway (Debian's nginx-light).
#
#   docker/standins/build.sh               # as root (debootstrap); idempotent, cached
#   docker/standins/build.sh --force       # also replace images of those names not built here
#   docker/standins/build.sh --arch arm64 --only "supernode superexec"
#                                          # another architecture (QEMU user-mode emulation), some images
#
# Everything starts from a Debian bookworm root file system made by debootstrap and imported
# with `docker import` (fibos-fl/debian-base:bookworm-<arch>). The base is made once per
# machine and remade only when its inputs (suite, packages, architecture, CA bundle) change; the
# images on top are ordinary `docker build`s, so Docker's layer cache rebuilds only what changed.
# An image of the same name that this script did not build (e.g. the official one, pulled) is
# left alone unless --force is given: operators keep the official images by default.
#
# For an architecture other than the host's, the images get the architecture appended to their
# tag (flwr/supernode:<tag>-arm64), since one engine holds one image per name; the host needs
# binfmt_misc (the script installs Debian's qemu-user-static and binfmt-support and registers
# the emulators where missing). The arm64 debootstrap runs in two stages, the second under QEMU.
#
# Environment: FIBOS_STANDIN_CACHE (default /var/cache/fibos-docker) holds the debootstrap
# tree while it is imported, and the build logs; DEBIAN_MIRROR overrides debootstrap's mirror.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
force=0
only=""
host_arch="$(dpkg --print-architecture)"
arch="$host_arch"
while [ "$#" -gt 0 ]; do
    case "$1" in
        --force) force=1 ;;
        --arch) arch="$2"; shift ;;
        --only) only="$2"; shift ;;
        -h | --help) sed -n '2,28p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
    shift
done
suffix=""
[ "$arch" = "$host_arch" ] || suffix="-$arch"

suite=bookworm
packages=python3,python3-venv,python3-pip,ca-certificates
cache="${FIBOS_STANDIN_CACHE:-/var/cache/fibos-docker}"
base="fibos-fl/debian-base:${suite}-${arch}"
label=org.fibos-fl.standin

say() { printf '[standins %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

# The names come from the files that use them, so a version bump there is followed here.
mapfile -t flower_images < <(grep -hoE 'flwr/(superlink|supernode|superexec):[A-Za-z0-9._-]+' \
    "$repo/docker-compose.yml" "$repo/docker/app.Dockerfile" | sort -u)
nginx_image="$(grep -hoE 'image: nginx:[A-Za-z0-9._-]+' "$repo/docker-compose.yml" | head -1 | cut -d' ' -f2)"
if [ "${#flower_images[@]}" -lt 3 ] || [ -z "$nginx_image" ]; then
    echo "image names not found in the compose file" >&2
    exit 1
fi

# Refuse to shadow an image this script did not build.
may_replace() {
    local image="$1" mark
    mark="$(docker image inspect -f "{{ index .Config.Labels \"$label\" }}" "$image" 2>/dev/null || true)"
    if docker image inspect "$image" >/dev/null 2>&1 && [ "$mark" != "1" ] && [ "$force" = 0 ]; then
        say "keeping $image (not a stand-in built here; --force replaces it)"
        return 1
    fi
}

# QEMU user-mode emulation for $arch binaries, registered with the fix-binary flag so that it
# also works inside containers and chroots (Debian's qemu-user-static registers it that way).
ensure_emulation() {
    local qemu_arch
    case "$arch" in arm64) qemu_arch=aarch64 ;; armhf) qemu_arch=arm ;; *) qemu_arch="$arch" ;; esac
    [ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
    if [ ! -e "/proc/sys/fs/binfmt_misc/qemu-$qemu_arch" ]; then
        say "installing qemu-user-static and binfmt-support"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends qemu-user-static binfmt-support >/dev/null
        update-binfmts --enable "qemu-$qemu_arch"
    fi
    grep -q '^flags:.*F' "/proc/sys/fs/binfmt_misc/qemu-$qemu_arch" \
        || { echo "qemu-$qemu_arch is registered without the fix-binary flag" >&2; exit 1; }
}

# --- base: debootstrap + docker import, remade when its inputs change ---
# The host's CA bundle is an input: where outbound TLS passes through an inspecting proxy, its CA
# is in that bundle, and pip inside the builds needs it (a changed bundle remakes the base).
bundle=/etc/ssl/certs/ca-certificates.crt
inputs="$( (printf '%s\n' "$suite" "$arch" "$packages" "${DEBIAN_MIRROR:-}"; cat "$bundle") | sha256sum | cut -c1-16)"
have="$(docker image inspect -f "{{ index .Config.Labels \"$label.inputs\" }}" "$base" 2>/dev/null || true)"
if [ "$have" != "$inputs" ]; then
    command -v debootstrap >/dev/null || {
        say "installing debootstrap"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
    }
    root="$cache/rootfs-$suite-$arch"
    rm -rf "$root"
    mkdir -p "$cache"
    say "debootstrap $suite ($arch) into $root"
    foreign=()
    [ -z "$suffix" ] || { ensure_emulation; foreign=(--foreign); }
    # shellcheck disable=SC2086  # DEBIAN_MIRROR is one optional word
    debootstrap "${foreign[@]}" --variant=minbase --arch="$arch" --include="$packages" "$suite" "$root" \
        ${DEBIAN_MIRROR:-} >"$cache/debootstrap-$arch.log" 2>&1 || { tail -20 "$cache/debootstrap-$arch.log" >&2; exit 1; }
    if [ -n "$suffix" ]; then
        say "debootstrap second stage under emulation (slow)"
        chroot "$root" /debootstrap/debootstrap --second-stage >>"$cache/debootstrap-$arch.log" 2>&1 \
            || { tail -20 "$cache/debootstrap-$arch.log" >&2; exit 1; }
    fi
    # The host's trust anchors, for pip (told to use the system bundle) and Python's ssl.
    install -m 0644 "$bundle" "$root$bundle"
    printf '[global]\ncert = %s\n' "$bundle" >"$root/etc/pip.conf"
    # apt's lists and the package cache are not part of a base image.
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
    say "loading $base"
    # Not `docker import`: Debian 12's engine records the host's architecture on imported images.
    tar -C "$root" --numeric-owner -cf "$cache/layer-$arch.tar" .
    python3 "$here/rootfs_image.py" --layer "$cache/layer-$arch.tar" --arch "$arch" --tag "$base" \
        --label "$label=1" --label "$label.inputs=$inputs" \
        --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --out "$cache/image-$arch.tar"
    docker load -q -i "$cache/image-$arch.tar" >/dev/null
    rm -rf "$root" "$cache/layer-$arch.tar" "$cache/image-$arch.tar"
else
    say "$base is up to date"
fi

build() {
    local target="$1" image="$2"
    shift 2
    [ -z "$only" ] || [[ " $only " == *" $target "* ]] || return 0
    may_replace "$image" || return 0
    say "building $image (target $target)"
    # Host network: on hosts whose bridge network has no route to the package mirrors, the
    # build's pip and apt still reach them; elsewhere it changes nothing.
    local log="$cache/build-$target-$arch.log"
    mkdir -p "$cache"
    if ! docker build --platform "linux/$arch" --network host --target "$target" --label "$label=1" \
        --build-arg "BASE_IMAGE=$base" "$@" -t "$image" -f "$here/standins.Dockerfile" "$here" >"$log" 2>&1; then
        tail -30 "$log" >&2
        echo "building $image failed (full log: $log)" >&2
        exit 1
    fi
}

for image in "${flower_images[@]}"; do
    name="${image%%:*}"
    tag="${image#*:}"
    # The tag's leading version is the Flower release (1.42.0-py3.13-ubuntu24.04 -> 1.42.0).
    build "${name#flwr/}" "$image$suffix" --build-arg "FLWR_VERSION=${tag%%-*}"
done
build nginx "$nginx_image$suffix"
say "done ($arch)"
