#!/usr/bin/env bash
# Installs what crates/mlaserve-deploy-tests needs to render and validate the Helm chart,
# from PyPI into a venv, pinned:
#   helm-python-sdk      Helm's own Go SDK (v4) as a shared library with a Python API: it
#                        renders and lints helm/mlaserve the way `helm template` / `helm
#                        lint` do, with no `helm` binary and no cluster;
#   kubernetes-validate  checks manifests against the Kubernetes API's JSON schemas, which
#                        it bundles (no network at validation time).
#
# Usage: tools/ci/install-k8s-validate.sh [VENV_DIR]    (default: <repo>/.venv-k8s)
# The tests look for <repo>/.venv-k8s, or MLASERVE_K8S_VENV when set. Prints, last, the
# venv's path. Safe to re-run.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${1:-${MLASERVE_K8S_VENV:-$repo/.venv-k8s}}"
python="${PYTHON:-python3}"

pkgs=(
  "kubernetes-validate==1.37.0"
  "helm-python-sdk==0.2.2"
)

if [[ ! -x "$venv/bin/python" ]]; then
  echo "creating venv $venv" >&2
  "$python" -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${pkgs[@]}" >&2

# Check that both really run, and that the validator has its schemas with it.
"$venv/bin/kubernetes-validate" --version >&2
"$venv/bin/python" - >&2 <<'PY'
import helm_python, kubernetes_validate.utils as kv
print("helm SDK", helm_python.helm_sdk_version(), "- kubernetes schemas", ", ".join(sorted(set(kv.all_versions()), key=lambda v: tuple(map(int, v.split("."))))))
PY
echo "$venv"
