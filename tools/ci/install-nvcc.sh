#!/usr/bin/env bash
# Installs the pinned CUDA 13.0 compiler toolchain from PyPI into a venv,
# so that `cargo build -p mlaserve-cuda --features cuda` can compile kernels/*.cu on a
# machine with no GPU and no system CUDA (developers' machines, CI).
#
# Usage: tools/ci/install-nvcc.sh [VENV_DIR]      (default: <repo>/.venv-nvcc)
# Prints, last, the export line that points the build at the toolkit:
#   export CUDA_HOME=<venv>/lib/python3.X/site-packages/nvidia/cu13
#
# Every package is pinned to 13.0: left unpinned, nvidia-nvvm comes as a newer release
# whose PTX the 13.0 ptxas (and the GPU machines' 580 driver) refuses.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${1:-${NVCC_VENV:-$repo/.venv-nvcc}}"
python="${PYTHON:-python3}"

pkgs=(
  "nvidia-cuda-nvcc==13.0.88"
  "nvidia-nvvm==13.0.*"
  "nvidia-cuda-runtime==13.0.*"
  "nvidia-cuda-crt==13.0.*"
  "nvidia-cuda-cccl==13.0.*"
)

if [[ ! -x "$venv/bin/python" ]]; then
  echo "creating venv $venv" >&2
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${pkgs[@]}" >&2

site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cuda_home="$site/nvidia/cu13"
nvcc="$cuda_home/bin/nvcc"
if [[ ! -x "$nvcc" ]]; then
  echo "error: nvcc not found at $nvcc after install" >&2
  exit 1
fi
# The pip layout splits the toolkit over several packages that all land in nvidia/cu13;
# nvcc finds cicc through nvvm/bin and ptxas in bin. Check that it really runs.
"$nvcc" --version >&2
echo "nvcc: $nvcc" >&2
echo "export CUDA_HOME=$cuda_home"
