#!/usr/bin/env bash
# Prepares everything spardl-grace needs on a fresh Debian machine and prints the path of the
# virtual environment on its last line of stdout. Idempotent and cached:
#   - Debian packages (Open MPI, cmake, g++, iproute2) are installed only when missing;
#   - the venv lives outside the checkout under $SPARDL_CACHE (default ~/.cache/spardl-grace),
#     named by a hash of the requirement files, so a second run reuses it;
#   - Horovod 0.28.1 is built once into a wheel (keyed by its version and torch's) and installed
#     into the venv; set SPARDL_SKIP_HOROVOD=1 to skip it.
# Progress goes to stderr so callers can do: VENV=$(bash scripts/setup_env.sh | tail -n 1)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CACHE=${SPARDL_CACHE:-$HOME/.cache/spardl-grace}
PYTHON=${PYTHON:-python3}
log() { echo "[setup_env] $*" >&2; }

install_debian_packages() {
    local pkgs=(openmpi-bin libopenmpi-dev cmake g++ iproute2 dataset-fashion-mnist)
    local missing=()
    for p in "${pkgs[@]}"; do
        dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        log "apt-get install ${missing[*]}"
        local sudo=""
        [ "$(id -u)" = 0 ] || sudo="sudo"
        $sudo apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
    fi
}

requirements_hash() {
    cat "$ROOT"/requirements/*.txt | sha256sum | cut -c1-16
}

make_venv() {
    local venv=$1
    if [ -x "$venv/bin/python" ] && [ -f "$venv/.complete" ]; then
        return
    fi
    log "creating $venv"
    rm -rf "$venv"
    mkdir -p "$(dirname "$venv")"
    "$PYTHON" -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip setuptools wheel >&2
    "$venv/bin/pip" install -q -r "$ROOT/requirements/dev.txt" >&2
    touch "$venv/.complete"
}

# Horovod 0.28.1 forces -std=c++14 in its CMake files while torch >= 2.1 needs C++17. A compiler
# wrapper that rewrites the -std flag is the smallest change that builds it without touching
# Horovod's sources (see ../shared/reference/STACK.md).
build_horovod_wheel() {
    local venv=$1
    local hvd_version torch_version wheel_dir
    hvd_version=$(sed -n 's/^horovod==//p' "$ROOT/requirements/horovod.txt")
    torch_version=$("$venv/bin/python" -c 'import torch; print(torch.__version__)')
    wheel_dir="$CACHE/wheels/horovod-$hvd_version-torch-$torch_version-py$("$venv/bin/python" -c 'import sys; print("%d%d" % sys.version_info[:2])')"
    if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
        log "building Horovod $hvd_version against torch $torch_version (about 10 minutes on 2 cores)"
        mkdir -p "$CACHE/bin" "$wheel_dir.tmp"
        cat > "$CACHE/bin/g++-cxx17" <<'EOF'
#!/usr/bin/env bash
args=()
for a in "$@"; do
    case "$a" in
        -std=c++11|-std=c++14|-std=gnu++11|-std=gnu++14) args+=("-std=c++17") ;;
        *) args+=("$a") ;;
    esac
done
exec /usr/bin/g++ "${args[@]}"
EOF
        chmod +x "$CACHE/bin/g++-cxx17"
        CXX="$CACHE/bin/g++-cxx17" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
            HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
            MAKEFLAGS="-j$(nproc)" \
            "$venv/bin/pip" wheel -q --no-deps --no-build-isolation --no-binary horovod \
            -w "$wheel_dir.tmp" "horovod==$hvd_version" >&2
        rm -rf "$wheel_dir"
        mv "$wheel_dir.tmp" "$wheel_dir"
    fi
    if ! "$venv/bin/python" -c 'import horovod.torch' >/dev/null 2>&1; then
        log "installing Horovod wheel into the venv"
        "$venv/bin/pip" install -q --no-deps "$wheel_dir"/horovod-*.whl >&2
        # Horovod's own runtime needs (its wheel is installed without resolving them).
        "$venv/bin/pip" install -q cloudpickle psutil pyyaml packaging cffi >&2
    fi
}

install_debian_packages
VENV="$CACHE/venv-$(requirements_hash)"
make_venv "$VENV"
if [ "${SPARDL_SKIP_HOROVOD:-0}" != 1 ]; then
    build_horovod_wheel "$VENV"
fi
"$VENV/bin/pip" install -q --no-deps --no-build-isolation -e "$ROOT" >&2
echo "$VENV"
