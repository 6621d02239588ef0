#!/usr/bin/env bash
# One-time set-up: software Vulkan when no GPU driver is present, the models (SmolLM2-135M,
# Qwen2.5-Coder-0.5B and Gemma 3 270M), the official OpenAI, Anthropic and Ollama Python
# clients for the end-to-end tests, and Chromium with selenium for the chat page's test.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! dpkg -s mesa-vulkan-drivers >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y mesa-vulkan-drivers
  else
    echo "note: install a Vulkan driver (or Mesa's lavapipe) for your system" >&2
  fi
fi
# A C compiler: the linker rustc calls, and `ring` (TLS for pipeline workers) builds C and assembly.
if ! command -v cc >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y gcc libc6-dev
fi
# curl: scripts/replicas.sh waits on the replicas' and the router's HTTP endpoints with it.
if ! command -v curl >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y curl
fi
# Chromium and its WebDriver: the chat page's browser test (tests/webui_selenium.py).
if ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y chromium chromium-driver
fi
./scripts/fetch-model.sh all
# Mesa's RADV (bookworm-backports, into ~/.cache/torus-wgpu; the system's Mesa is not touched)
# and the driver shim in front of its null device: the GPU compiler report's test
# (tests/compiler_report.rs) compiles every gpu-profile kernel for AMD targets with it.
if command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1; then
  ./scripts/fetch-radv.sh >/dev/null
else
  echo "note: tests/compiler_report.rs needs scripts/fetch-radv.sh (Debian's apt-get and dpkg-deb)" >&2
fi
# pip_install PKG...: a system Python that refuses user packages (PEP 668) gets them with
# --break-system-packages.
pip_install() {
  python3 -m pip install --quiet "$@" || python3 -m pip install --quiet --user --break-system-packages "$@"
}
# The official OpenAI Python client (with pydantic, which it uses, and jsonschema), used by the
# end-to-end tests (tests/openai_e2e.py); pyzmq, msgpack and msgspec decode the KV-cache events
# (tests/kv_events_sub.py).
python3 -c 'import openai, pydantic, jsonschema, zmq, msgpack, msgspec' 2>/dev/null ||
  pip_install openai pydantic jsonschema pyzmq msgpack msgspec
# The official Anthropic and Ollama clients (tests/apis_e2e.py) and selenium, which drives
# Chromium for the chat page's test (tests/webui_selenium.py).
python3 -c 'import anthropic, ollama, selenium' 2>/dev/null || pip_install anthropic ollama selenium
# litellm, whose `ollama_chat/` provider tests/apis_e2e.py drives (it sends no Content-Type).
LITELLM_LOCAL_MODEL_COST_MAP=True python3 -c 'import litellm' 2>/dev/null || pip_install litellm
# The Shepherd Model Gateway (the `smg` router) for the replicas test and scripts/replicas.sh.
[ "$(smg --version 2>/dev/null | grep -o '[0-9.]*' | head -1)" = "1.13.0" ] || pip_install smg==1.13.0
