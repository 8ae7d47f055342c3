#!/usr/bin/env bash
# Builds a Debian 12 (bookworm) base image locally with debootstrap, for machines that
# cannot pull images from a registry. The project's Dockerfiles take it as BASE_IMAGE;
# where Docker Hub is reachable, `debian:bookworm-slim` does the same job.
#
#   deploy/base/build-base-image.sh [IMAGE_NAME]     (default liveloop-base:bookworm)
#
# Needs root, debootstrap, a running Docker daemon (DOCKER_HOST is honoured) and a Debian
# mirror (the first `URIs:`/`deb` line of the host's apt sources, or $DEBIAN_MIRROR).
# The host's CA bundle is copied in so that pip and apt inside containers trust the same
# registries (and TLS-intercepting proxies) as the host.
set -euo pipefail
image="${1:-liveloop-base:bookworm}"
suite="${DEBIAN_SUITE:-bookworm}"
docker="${DOCKER:-docker}"

mirror="${DEBIAN_MIRROR:-}"
if [ -z "$mirror" ]; then
    mirror="$(grep -rhoE '^(URIs:|deb) +https?://[^ ]+' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
        | grep -m1 -E 'debian/?$' | awk '{print $2}' || true)"
fi
mirror="${mirror:-http://deb.debian.org/debian}"

rootfs="$(mktemp -d)"
trap 'rm -rf "$rootfs"' EXIT
echo "debootstrap $suite from $mirror (a few minutes)"
debootstrap --variant=minbase \
    --include=ca-certificates,python3,python3-venv,python3-pip \
    "$suite" "$rootfs" "$mirror" >"$rootfs.log" 2>&1 || { tail -20 "$rootfs.log"; exit 1; }
rm -f "$rootfs.log"

if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
fi
cat >"$rootfs/etc/apt/sources.list" <<SOURCES
deb $mirror $suite main
deb $mirror $suite-updates main
SOURCES
# Keep images small: no docs, no apt caches.
cat >"$rootfs/etc/dpkg/dpkg.cfg.d/01-nodoc" <<'NODOC'
path-exclude /usr/share/doc/*
path-exclude /usr/share/man/*
path-exclude /usr/share/locale/*
NODOC
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*

tar -C "$rootfs" -c . | "$docker" import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["/bin/bash"]' \
    - "$image" >/dev/null
echo "built $image"
