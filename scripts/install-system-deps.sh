#!/usr/bin/env bash
# Debian packages the tests and the demo need. Idempotent; quiet when everything is present.
#  - qemu-system-x86: real MicroVMs (tests/vm, the demo); the shim uses q35 + TCG/KVM
#  - cpio: reading guest images in tests (the builder writes cpio itself)
#  - apt package lists: `cubeaccel image build` fetches the guest kernel, busybox and python with `apt-get download`
#  - postgresql: server binaries for tests/postgres (initdb/pg_ctl in a temp dir; no system cluster is used)
#  - util-linux (setpriv, prlimit): the pinned-memory test drops CAP_IPC_LOCK and lowers RLIMIT_MEMLOCK
#  - chromium: the web dashboard's test drives Debian's headless Chromium over the DevTools protocol
#  - iproute2, nftables: sandbox networks (a namespace, TAP, veth and nftables rules per sandbox; host/net/netpolicy.py)
#  - e2fsprogs (mkfs.ext4): the sandbox's capped scratch disk (host/vmm/scratch.py)
set -euo pipefail
need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v cpio >/dev/null || need+=(cpio)
command -v gcc >/dev/null || need+=(gcc)
command -v setpriv >/dev/null && command -v prlimit >/dev/null || need+=(util-linux)
command -v chromium >/dev/null || need+=(chromium)
command -v ip >/dev/null || need+=(iproute2)
command -v nft >/dev/null || need+=(nftables)
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
# PostgreSQL server binaries for the CubeMaster replica tests (a throwaway cluster per test session)
command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
lists_missing() {
  # apt-get download needs package lists with a candidate for the kernel meta-package.
  local policy
  policy="$(apt-cache policy linux-image-amd64 2>/dev/null || true)"
  [[ "$policy" != *"Candidate: "[0-9]* ]]
}
if [ ${#need[@]} -gt 0 ] || lists_missing; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing Debian packages or apt lists: ${need[*]:-lists} (run as root to install)" >&2
    exit 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null || true
  if [ ${#need[@]} -gt 0 ]; then
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
fi
