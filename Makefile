# lockstep: one-command entry points (see README.md).
#   make demo   installs what is missing, builds, and trains the bundled example with 2 MPI replicas
#   make test   installs what is missing, builds once (release, every target), runs make lint, the main job on
#               2 updates and every test (among them MPI jobs across two hosts simulated with
#               network namespaces, scripts/two-hosts.sh: they need root, and the GPU tests on
#               the machine's Vulkan adapter: Mesa's lavapipe without a GPU)
#   make python builds and installs the Python package (python/) from the release build
#   make lint   cargo fmt --check, clippy and rustdoc with warnings denied (with the cuda feature),
#               no two files of a crate import each other (scripts/check_layout.py), and
#               `cargo test` reuses the release build's libraries (scripts/check_one_compile.py),
#               the programs name no burn backend type (scripts/check_generic_entries.py)
# mpirun refuses to run as root unless told; these variables allow it (harmless otherwise).
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
# The tests' own environment (HDF5_USE_FILE_LOCKING, mpirun as root) is in .cargo/config.toml,
# so that `cargo test` needs no Makefile.
# The Vulkan loader complains on every start when XDG_RUNTIME_DIR is unset (CI, containers).
export XDG_RUNTIME_DIR ?= /tmp

# Python by its own path, never through a pyenv shim: a shim puts pyenv's folders in front of
# PATH for everything it starts, pyo3's build script reruns when PATH changes, and every cargo
# under such a python (check_one_compile.py, pip building the package) compiled pyo3, numpy and
# lockstep-py again, 2.5 minutes each time on CI (pyo3's other inputs: .cargo/config.toml).
PYTHON := $(shell python3 -c 'import sys; print(sys.executable)' 2>/dev/null || echo python3)

.PHONY: setup build build-all lint test demo python

setup:
	bash scripts/setup.sh

build: setup
	cargo build --release --workspace

# `make test` builds every target in one cargo run (libraries, binaries, test binaries): the
# tests that do not need lockstep-npe compile on the second core while lockstep-npe, the
# longest crate (about 3 minutes on 2 cores), compiles alone; built after the workspace,
# they waited for it. The libraries are the same as `build`'s (scripts/check_one_compile.py).
build-all: setup
	cargo build --release --workspace --all-targets

# Guardrails: formatting, clippy and rustdoc with warnings denied (the workspace lints in
# Cargo.toml: missing_docs, unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks).
# scripts/check_layout.py: no circle of imports between the files of a crate; LAYOUT_ARGS adds
# --skip-cycles CRATE (a crate being restructured) and --max-lines DIR=N (a file size limit).
LAYOUT_ARGS ?= --max-lines crates/lockstep-snn/src=1000
CUDA_FEATURE := lockstep-cli/cuda
lint: setup
	$(PYTHON) scripts/check_layout.py crates $(LAYOUT_ARGS)
	cargo fmt --all --check
	# Clippy and rustdoc see the `cuda` feature too: the NPE crate's CUDA backend compiles
	# without a CUDA toolkit (burn 0.21 loads the CUDA libraries at run time) and runs only
	# where a GPU exists. Both take the same features, so rustdoc reuses clippy's check of the
	# dependencies (a separate `cargo check --features cuda` checked burn and its stack again).
	cargo clippy --release --workspace --all-targets --features $(CUDA_FEATURE) -- -D warnings
	RUSTDOCFLAGS="-D warnings" cargo doc --release --workspace --no-deps --features $(CUDA_FEATURE)
	# One compile per `make test`: no dev-dependency may switch on a feature of a library (test
	# helpers live in lockstep-testkit, a crate only [dev-dependencies] name), or `cargo test`
	# recompiles every crate above it (10 minutes on CI). This builds the tests (`--no-run`,
	# which `make test` needs anyway) and fails, naming the crate and features, when a library
	# of the test build differs from the release build's.
	$(PYTHON) scripts/check_one_compile.py --profile release --package lockstep-py
	# The programs reach burn's backends through lockstep-npe's non-generic entries
	# (DeviceModel, Trained, sampling::draw): release builds share no generic instantiations
	# between crates, so a program naming NpeModel<B> compiles the network again (4-5 minutes
	# each for the CLI and the Python extension).
	$(PYTHON) scripts/check_generic_entries.py crates/lockstep-cli/src python/src

# The Python package (python/: PyO3 bindings built by maturin), installed into python3. Run
# after `build`, it compiles nothing: the workspace build compiled the bindings crate
# lockstep-py with the features of the other members (scripts/check_one_compile.py --package
# lockstep-py checks it in `make lint`) and the build inputs pyo3 takes from maturin (PYTHON
# above, .cargo/config.toml), so maturin finds the extension up to date and packages it. It
# fails when maturin compiled the extension again all the same.
EXTENSION := target/release/lib_lockstep.so
python: build
	@before=$$(stat -c %Y $(EXTENSION)); \
	echo "$(PYTHON) -m pip install --quiet --no-build-isolation --no-deps --force-reinstall ./python"; \
	$(PYTHON) -m pip install --quiet --no-build-isolation --no-deps --force-reinstall ./python || exit 1; \
	if [ "$$(stat -c %Y $(EXTENSION))" != "$$before" ]; then \
	  echo "make python: maturin compiled lockstep-py again instead of reusing $(EXTENSION) of the workspace build (the package is installed; pyo3's build inputs differ: PATH, PYO3_* in .cargo/config.toml)" >&2; exit 1; fi

# The main job: train the bundled 300-cell GLIF3 network with 2 MPI replicas.
DEMO_ARGS ?=
demo: build
	mpirun -n 2 --oversubscribe --bind-to none target/release/lockstep train examples/glif_all2all/config.mpi.json $(DEMO_ARGS)

# The guardrails, the main job itself on a reduced schedule (2 updates), then every test.
test: build-all
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory demo DEMO_ARGS="--updates 2 --output-dir target/demo-smoke --overwrite"
	cargo test --release --workspace
	$(MAKE) --no-print-directory python
	$(PYTHON) -m pytest -q python/tests
