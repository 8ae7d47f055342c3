#!/usr/bin/env bash
# Installs Debian packages that are missing (needs root or sudo, and apt).
#   deploy/tools/install-debian.sh COMMAND PACKAGE [COMMAND PACKAGE ...]
# e.g. install-debian.sh promtool prometheus dockerd docker.io
set -euo pipefail
missing=()
while [ $# -ge 2 ]; do
    command -v "$1" >/dev/null 2>&1 || missing+=("$2")
    shift 2
done
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=""
if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "install-debian: need root to install ${missing[*]}" >&2; exit 1; }
    sudo=sudo
fi
command -v apt-get >/dev/null || { echo "install-debian: no apt-get; install ${missing[*]} yourself" >&2; exit 1; }
echo "installing ${missing[*]} (apt)"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
