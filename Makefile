# lockstep: one-command entry points (see README.md).
#   make demo   installs what is missing, builds, and runs the main job on the bundled example
#   make test   installs what is missing, builds once (release) and runs every test
# mpirun refuses to run as root unless told; these variables allow it (harmless otherwise).
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
# Child processes (mpirun, python) inherit open HDF5 files and their locks; tests that open a
# file while another thread spawns a process would then fail to lock it.
export HDF5_USE_FILE_LOCKING := FALSE

.PHONY: setup build test demo

setup:
	bash scripts/setup.sh

build: setup
	cargo build --release --workspace

test: setup
	cargo test --release --workspace

demo: build
	mpirun -n 2 --oversubscribe target/release/lockstep info
