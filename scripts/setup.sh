#!/usr/bin/env bash
# Installs what lockstep needs to build and test, when it is missing. Idempotent; safe to rerun.
#   system (Debian/Ubuntu, apt-get): Open MPI, HDF5, libclang (for the MPI bindings), pkg-config,
#     iproute2 and mount (the two-host test bed, scripts/two-hosts.sh), the Vulkan loader and
#     Mesa's Vulkan drivers (libvulkan1, mesa-vulkan-drivers: lavapipe, the software GPU
#     adapter every GPU test runs on without a GPU)
#   Python (pip, for the tests' cross-checks with h5py/numpy and the SONATA reference reader):
#     h5py, numpy, libsonata (pinned: LIBSONATA below); for the Python package (python/):
#     maturin (its build backend), pytest and mpi4py (its tests; pinned below)
# Run as root or with sudo available. Exits non-zero with a message saying what to install by
# hand when it cannot install.
set -euo pipefail

packages=(libopenmpi-dev openmpi-bin libhdf5-dev libclang-dev pkg-config iproute2 mount libvulkan1 mesa-vulkan-drivers)

say() { printf 'setup: %s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

if command -v dpkg-query >/dev/null 2>&1; then
  missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]}"
    if [ "$(id -u)" -eq 0 ]; then
      sudo=()
    elif command -v sudo >/dev/null 2>&1; then
      sudo=(sudo)
    else
      die "not root and no sudo: install ${missing[*]} (apt-get install ${missing[*]}) and rerun"
    fi
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get update -qq || die "apt-get update failed; install ${missing[*]} by hand"
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
      || die "apt-get install failed; install ${missing[*]} by hand"
  fi
else
  for tool in mpicc mpirun h5cc pkg-config ip; do
    command -v "$tool" >/dev/null 2>&1 || die "no apt-get here and $tool is missing: install Open MPI, HDF5 (with h5cc), libclang, pkg-config and iproute2 with your package manager"
  done
fi

command -v cargo >/dev/null 2>&1 || die "cargo is missing: install Rust with rustup (https://rustup.rs) and rerun"

# The libsonata wheel the tests read lockstep's SONATA files with (lockstep-testkit's
# LIBSONATA_VERSION names the same).
LIBSONATA=0.2.2

if command -v python3 >/dev/null 2>&1; then
  if ! python3 -c 'import h5py, numpy' >/dev/null 2>&1; then
    say "installing the Python packages h5py and numpy (used by the tests to read our files)"
    python3 -m pip install --quiet h5py numpy \
      || say "warning: pip could not install h5py/numpy; the tests that cross-check with them will fail until they are installed"
  fi
  if ! python3 -c "import importlib.metadata as m, sys; sys.exit(m.version('libsonata') != '$LIBSONATA')" >/dev/null 2>&1; then
    say "installing the Python package libsonata==$LIBSONATA (the SONATA reference reader the tests open our files with)"
    python3 -m pip install --quiet "libsonata==$LIBSONATA" \
      || say "warning: pip could not install libsonata==$LIBSONATA; the tests that read our files with it will fail until it is installed"
  fi
fi
# The Python package's build backend and the tools of its tests (`make test` builds it with
# `pip install --no-build-isolation ./python`, reusing the release build).
PY_TOOLS=("maturin==1.16.0" "pytest==9.2.0" "mpi4py==4.1.2")
if command -v python3 >/dev/null 2>&1; then
  missing_py=()
  for spec in "${PY_TOOLS[@]}"; do
    name=${spec%%==*}; version=${spec##*==}
    python3 -c "import importlib.metadata as m, sys; sys.exit(m.version('$name') != '$version')" >/dev/null 2>&1 || missing_py+=("$spec")
  done
  if [ ${#missing_py[@]} -gt 0 ]; then
    say "installing the Python packages ${missing_py[*]} (the Python package's build and tests)"
    python3 -m pip install --quiet "${missing_py[@]}" \
      || say "warning: pip could not install ${missing_py[*]}; make test cannot build or test the Python package until they are installed"
  fi
fi
say "ok: $(mpirun --version 2>/dev/null | head -n1), HDF5 $(pkg-config --modversion hdf5 2>/dev/null || echo '?'), $(cargo --version)"
