#!/usr/bin/env bash
# One-time set-up of a fresh Debian/Ubuntu machine for minirsi (idempotent: safe to re-run).
#   - system packages: bubblewrap (the local sandbox), debootstrap (its root filesystem),
#     docker.io (the optional Docker backend; its daemon is started only by scripts/dockerd.sh)
#   - the sandbox rootfs: a minimal Debian with python3 + pytest, built once into
#     $MINIRSI_ROOTFS (default ~/.cache/minirsi/rootfs)
#   - Python packages: torch first and explicitly (a bare `torch` requirement can pull a
#     multi-GB CUDA build), then this project with its dev and docker extras.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
ROOTFS="${MINIRSI_ROOTFS:-$HOME/.cache/minirsi/rootfs}"
TORCH_SPEC="${MINIRSI_TORCH:-torch==2.13.0}"

need=()
command -v bwrap >/dev/null || need+=(bubblewrap)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v dockerd >/dev/null || need+=(docker.io)
if [ ${#need[@]} -gt 0 ]; then
  echo "[setup] apt-get install ${need[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

if [ ! -x "$ROOTFS/usr/bin/python3" ]; then
  echo "[setup] building the sandbox rootfs in $ROOTFS (debootstrap, ~1 min)"
  mkdir -p "$(dirname "$ROOTFS")"
  rm -rf "$ROOTFS.partial"
  # the same --include as minirsi/env/layers.py ROOTFS_PACKAGES (the Debian 13 base `task prepare` builds)
  $SUDO debootstrap --variant=minbase \
    --include=python3,python3-pytest,git,procps,tar,gzip,bzip2,xz-utils,zip,unzip,bc,gawk,findutils,diffutils,patch \
    bookworm "$ROOTFS.partial" http://deb.debian.org/debian >/dev/null
  mv "$ROOTFS.partial" "$ROOTFS"
fi

if ! python3 -c "import torch" 2>/dev/null; then
  echo "[setup] pip install $TORCH_SPEC"
  python3 -m pip install -q "$TORCH_SPEC"
fi
echo "[setup] pip install -e .[dev,docker]"
python3 -m pip install -q -e ".[dev,docker]"
echo "[setup] done (rootfs: $ROOTFS)"
