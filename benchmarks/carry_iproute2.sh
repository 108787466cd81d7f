#!/usr/bin/env bash
# Packs this machine's iproute2 (ip, tc and the libraries they need beyond the C library) into
# DEST (default .ipr in the checkout, which git ignores) for a machine that has the kernel's
# namespaces, veth and tbf but no iproute2 and no package registry, such as the lent GPU
# machines: carry DEST there and put it first on PATH, and testbed.netem emulates links.
# Each wrapper starts its binary through that machine's own loader with DEST/lib as the library
# path, so the programs `ip netns exec` starts do not inherit these libraries.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=${1:-$ROOT/.ipr}
mkdir -p "$DEST/lib"
for tool in ip tc; do
    binary=$(readlink -f "$(command -v "$tool")")
    cp "$binary" "$DEST/bin_$tool"
    ldd "$binary" | awk '/=>/ {print $3}' | grep -v -e '/libc\.so' -e '/libm\.so' -e 'ld-linux' \
        | xargs -r -I{} cp -L {} "$DEST/lib/"
    cat > "$DEST/$tool" <<WRAPPER
#!/bin/sh
here=\$(dirname "\$(readlink -f "\$0")")
exec /lib64/ld-linux-x86-64.so.2 --library-path "\$here/lib" "\$here/bin_$tool" "\$@"
WRAPPER
    chmod +x "$DEST/$tool"
done
"$DEST/ip" -V
