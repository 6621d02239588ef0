#!/usr/bin/env bash
# Mesa 25.0.7's RADV (AMD's Vulkan driver) from Debian's bookworm-backports, for the GPU compiler
# report (scripts/gpu-compiler-report.sh, tests/compiler_report.rs): downloaded once with
# apt-get under a private apt state and extracted with dpkg-deb into
# ~/.cache/torus-wgpu/mesa-25.0.7 (TORUS_RADV_DIR), with the libdrm it needs; the system's Mesa
# (lavapipe) is not touched. Then the driver shim in front of its null device
# (scripts/radv-shim/shim.c, built with Vulkan's headers from Debian's libvulkan-dev) and the
# loader's manifest for it. Does nothing that is done already. Prints the folder.
set -euo pipefail
cd "$(dirname "$0")/.."
MESA_VERSION=25.0.7-2~bpo12+1
DIR=${TORUS_RADV_DIR:-$HOME/.cache/torus-wgpu/mesa-25.0.7}
LIB=$DIR/root/usr/lib/x86_64-linux-gnu
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
if [ ! -f "$LIB/libvulkan_radeon.so" ]; then
  APT="$DIR/apt"
  mkdir -p "$APT/lists/partial" "$APT/archives/partial" "$DIR/debs"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm-backports main" \
    > "$APT/sources.list"
  OPTS=(-o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT" -o "Dir::Etc::SourceList=$APT/sources.list"
        -o "Dir::Etc::SourceParts=/nonexistent" -o "Debug::NoLocking=1")
  quiet() { grep -v "^W: Download is performed unsandboxed" >&2 || true; }
  apt-get "${OPTS[@]}" update 2>&1 | quiet
  # (Only backports is listed: its libdrm is the candidate.)
  (cd "$DIR/debs" && apt-get "${OPTS[@]}" download "mesa-vulkan-drivers=$MESA_VERSION" libdrm2 libdrm-amdgpu1 2>&1 | quiet)
  for d in "$DIR"/debs/*.deb; do dpkg-deb -x "$d" "$DIR/root"; done
  [ -f "$LIB/libvulkan_radeon.so" ] || { echo "fetch-radv: no libvulkan_radeon.so in $DIR" >&2; exit 1; }
fi
if [ ! -f /usr/include/vulkan/vulkan.h ]; then
  $SUDO apt-get install -y libvulkan-dev >/dev/null || { $SUDO apt-get update >/dev/null && $SUDO apt-get install -y libvulkan-dev >/dev/null; }
fi
SHIM=$DIR/libtorus_radv_shim.so
if [ ! -f "$SHIM" ] || [ scripts/radv-shim/shim.c -nt "$SHIM" ]; then
  cc -shared -fPIC -O2 -Wall -o "$SHIM" scripts/radv-shim/shim.c -ldl
fi
printf '{"file_format_version": "1.0.0", "ICD": {"library_path": "%s", "api_version": "1.3.0"}}\n' "$SHIM" \
  > "$DIR/shim_icd.json"
echo "$DIR"
