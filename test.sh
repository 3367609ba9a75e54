#!/usr/bin/env bash
# Installs whatever is missing (Debian packages, the shared torch venv with the Python reference
# packages), builds, and runs every test through ctest. Exits non-zero on any failure.
# Idempotent: on a machine that has everything it goes straight to the build.
set -euo pipefail
cd "$(dirname "$0")"
source scripts/deps.sh

started=$(date +%s)
lorapipe_install_apt --test
lorapipe_ensure_venv --test
lorapipe_build
ctest --test-dir build --output-on-failure --parallel "${LORAPIPE_JOBS:-$(nproc)}" \
  --timeout 1200 "$@"
echo "[lorapipe] test.sh took $(($(date +%s) - started)) s"
