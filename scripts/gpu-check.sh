#!/usr/bin/env bash
# The prepared GPU run (issues 44, 45 and 46): correctness and speed of lockstep's GPU engine
# and of the NPE on GPUs, on a machine with a GPU but no Rust toolchain, in one call of at most
# 10 minutes. The NPE runs first: the spline kernels' test, the npe_gpu tests, `lockstep bench
# npe --device gpu` (and `--device cuda` for a GPU_CHECK_FEATURES=cuda bundle), PyTorch on
# cuda beside it when python3 has torch; then the N-body (issue 56: the nbody_gpu tests and
# `lockstep bench nbody --device gpu` at N = 1e6 and 1e7 beside the CPU FMM, direct sums at
# 1e5, 4 steps of the Gaussian-clumps example at 2e6 particles kept on the GPU, then the GPU
# FMM alone at N = 1e8);
# GPU_CHECK_ONLY=npe|nbody|snn runs one part.
#
#   scripts/gpu-check.sh bundle [TARBALL]   here, with Rust: builds the release binaries, strips
#                                           them and packs them with the shared libraries `ldd`
#                                           lists (Open MPI, HDF5 and theirs; not glibc) and the
#                                           Vulkan loader into TARBALL (default
#                                           target/gpu-bundle.tar.xz, about 20 MB)
#   scripts/gpu-check.sh run TARBALL OUTDIR on the GPU machine, from the repository root: unpacks,
#                                           finds the NVIDIA Vulkan driver, runs the GPU tests,
#                                           builds the V1 networks and runs `lockstep bench bptt
#                                           --device gpu` on the 300-cell, tenth-scale and full
#                                           V1 configs (with the spike and gradient comparison
#                                           against the CPU engine; the PyTorch peer,
#                                           scripts/peers/bptt_torch.py, in the same invocation
#                                           on 300-cell and tenth scale when python3 has torch), and
#                                           2 thread replicas sharing the GPU against 1; writes
#                                           OUTDIR/gpu-check.log (everything) and
#                                           OUTDIR/gpu-check.md (the table)
#
# With the session's device tool: `run` with carry ["target/gpu-bundle.tar.xz"] and the command
#   bash scripts/gpu-check.sh run target/gpu-bundle.tar.xz "$OUT"
# and a timeout of 600 s. GPU_CHECK_SKIP_FULL=1 leaves out full V1 (a shorter first call);
# GPU_CHECK_BUDGET_S (default 540) is the time after which the remaining steps are skipped.
set -uo pipefail

die() { printf 'gpu-check: error: %s\n' "$*" >&2; exit 1; }
say() { printf 'gpu-check: %s\n' "$*" >&2; }

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# The GPU test binaries: `cargo test --no-run` names each test executable.
# The whole workspace, as `make test` builds it: a `-p` selection resolves features
# differently and would compile everything a second time.
test_binaries() {
  cargo test --release --no-run --message-format=json --workspace \
    ${GPU_CHECK_FEATURES:+--features "lockstep-cli/$GPU_CHECK_FEATURES"} 2>/dev/null |
    python3 -c '
import json, sys
want = {"device", "gpu_engine", "gpu_train", "edge_cases_every_engine", "npe_gpu", "npe_library", "nbody_gpu"}
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] in want \
            and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])
    # The unit tests of lockstep-snn: the 32-bit kernel emulations against 64-bit arithmetic
    # on the adapter (wide_arith), which only a GPU can confirm survive its compiler.
    elif m.get("reason") == "compiler-artifact" and m.get("executable") \
            and m["target"]["name"] == "lockstep_snn" and m["target"]["kind"] == ["lib"]:
        print("snn_unit", m["executable"])
    # The unit tests of lockstep-nbody: the tree and the dual tree walk built on the device
    # against the host ones, node for node and row by row.
    elif m.get("reason") == "compiler-artifact" and m.get("executable") \
            and m["target"]["name"] == "lockstep_nbody" and m["target"]["kind"] == ["lib"]:
        print("nbody_unit", m["executable"])
'
}

bundle() {
  local tarball=${1:-$repo/target/gpu-bundle.tar.xz}
  command -v cargo >/dev/null || die "bundle needs cargo (run it on the development machine)"
  cd "$repo" || exit 1
  cargo build --release --workspace --all-targets \
    ${GPU_CHECK_FEATURES:+--features "lockstep-cli/$GPU_CHECK_FEATURES"} ||
    die "cargo build failed"
  local stage
  stage=$(mktemp -d)
  mkdir -p "$stage/bin" "$stage/tests" "$stage/lib"
  local target
  target=$(cd "${CARGO_TARGET_DIR:-target}" && pwd) || die "no target directory"
  cp "$target/release/lockstep" "$target/release/lockstep-nbody-check" "$stage/bin/"
  # The test binaries name the binaries they start by the paths of this build
  # (CARGO_BIN_EXE_*): the run puts copies there.
  echo "$target" >"$stage/TARGET_DIR"
  local name exe
  while read -r name exe; do
    cp "$exe" "$stage/tests/$name"
  done < <(test_binaries)
  [ -x "$stage/tests/gpu_train" ] || die "the GPU test binaries were not found (cargo test --no-run)"
  strip "$stage"/bin/* "$stage"/tests/*
  # Every library ldd lists but glibc's own (the GPU machine's image has a newer glibc).
  local lib
  for lib in $(ldd "$stage/bin/lockstep" "$stage"/tests/* | awk '/=> \//{print $3}' | sort -u); do
    case $(basename "$lib") in
      libc.so.*|libm.so.*|libpthread.so.*|libdl.so.*|librt.so.*|ld-linux*|libgcc_s.so.*|libresolv.so.*) ;;
      *) cp -L "$lib" "$stage/lib/" ;;
    esac
  done
  local vk
  vk=$(ldconfig -p | awk '/libvulkan.so.1 /{print $NF; exit}')
  [ -n "$vk" ] || die "libvulkan.so.1 is not installed here (apt-get install libvulkan1)"
  cp -L "$vk" "$stage/lib/"
  git -C "$repo" rev-parse --short HEAD >"$stage/COMMIT" 2>/dev/null || echo unknown >"$stage/COMMIT"
  echo "${GPU_CHECK_FEATURES:-}" >"$stage/FEATURES"
  mkdir -p "$(dirname "$tarball")"
  tar -C "$stage" -cJf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
  rm -rf "$stage"
  say "bundle: $tarball ($(du -h "$tarball" | cut -f1)); commit $(tar -xJOf "$tarball" ./COMMIT)"
}

# The NVIDIA Vulkan driver's manifest: the image's own, or one written for libGLX_nvidia.
nvidia_icd() {
  local f
  for f in /usr/share/vulkan/icd.d/nvidia_icd.json /etc/vulkan/icd.d/nvidia_icd.json \
           /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json \
           /usr/local/share/vulkan/icd.d/nvidia_icd.json; do
    [ -f "$f" ] && { echo "$f"; return 0; }
  done
  f=$(find / -xdev -name 'nvidia_icd*.json' 2>/dev/null | head -1)
  [ -n "$f" ] && { echo "$f"; return 0; }
  local glx
  glx=$(ldconfig -p | awk '/libGLX_nvidia.so.0 /{print $NF; exit}')
  [ -z "$glx" ] && glx=$(find / -xdev -name 'libGLX_nvidia.so.0' 2>/dev/null | head -1)
  [ -n "$glx" ] || return 1
  f=$work/nvidia_icd.json
  printf '{"file_format_version":"1.0.0","ICD":{"library_path":"%s","api_version":"1.3.0"}}\n' "$glx" >"$f"
  echo "$f"
}

run() {
  local tarball=${1:?usage: gpu-check.sh run TARBALL OUTDIR} out=${2:?usage: gpu-check.sh run TARBALL OUTDIR}
  local budget=${GPU_CHECK_BUDGET_S:-540} start=$SECONDS
  mkdir -p "$out" || die "cannot create $out"
  local log=$out/gpu-check.log md=$out/gpu-check.md
  : >"$log"
  work=$(mktemp -d)
  tar -C "$work" -xJf "$tarball" || die "cannot unpack $tarball"
  export LD_LIBRARY_PATH=$work/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp} HDF5_USE_FILE_LOCKING=FALSE
  local icd
  if icd=$(nvidia_icd); then
    export VK_DRIVER_FILES=$icd VK_ICD_FILENAMES=$icd
  fi
  local L=$repo/target/release/lockstep
  mkdir -p "$repo/target/release"
  cp "$work/bin/lockstep" "$L"
  # The binaries the test binaries start, where the build put them (see bundle).
  local built
  built=$(cat "$work/TARGET_DIR" 2>/dev/null)
  if [ -n "$built" ] && mkdir -p "$built/release" 2>/dev/null; then
    cp "$work"/bin/* "$built/release/"
  else
    say "cannot create the build target directory ${built:-(not recorded)}: tests that start lockstep-nbody-check will fail"
  fi
  # The test binaries look for the repository and the lockstep binary where they were
  # built (/work/main); point that path at this copy when it is free.
  if [ ! -e /work/main ]; then
    mkdir -p /work && ln -s "$repo" /work/main
  fi
  local commit
  commit=$(cat "$work/COMMIT")
  left() { echo $((budget - (SECONDS - start))); }
  step() { # step NAME LIMIT_S CMD...: runs CMD with a time limit, logging; skips when out of budget
    local name=$1 limit=$2
    shift 2
    if [ "$(left)" -lt 20 ]; then
      echo "== $name: skipped (out of time)" | tee -a "$log"
      return 1
    fi
    [ "$limit" -gt "$(left)" ] && limit=$(left)
    echo "== $name (limit ${limit}s)" >>"$log"
    local t0=$SECONDS rc
    timeout -k 5 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
    return $rc
  }
  {
    echo "commit $commit; $(date -u '+%F %T') UTC"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "nvidia-smi: n/a"
    echo "VK_DRIVER_FILES=${VK_DRIVER_FILES:-unset}"
    echo "libraries not found:"; ldd "$L" | grep 'not found' || echo "  none"
  } | tee -a "$log"
  step "lockstep info" 60 "$L" info
  local only=${GPU_CHECK_ONLY:-all} bench=$out/bench
  mkdir -p "$bench"
  if [ "$only" != snn ] && [ "$only" != nbody ]; then
    local mpi_skip=()
    command -v mpirun >/dev/null || mpi_skip=(--skip two_mpi_ranks)
    [ -x "$work/tests/npe_library" ] && step "test npe kernels" 60 "$work/tests/npe_library" activation_kernel:: spline_kernel:: --nocapture
    [ -x "$work/tests/npe_gpu" ] && step "test npe_gpu" 240 "$work/tests/npe_gpu" --test-threads=1 "${mpi_skip[@]}"
    local npe_peer="--no-torch"
    python3 -c 'import torch, numpy' 2>/dev/null && npe_peer="--python python3"
    step "bench npe gpu" 150 sh -c "'$L' bench npe --device gpu --batch 512 --steps 10 --warmup 2 $npe_peer | tee '$bench/npe_gpu.txt'"
    if grep -q cuda "$work/FEATURES" 2>/dev/null; then
      step "bench npe cuda" 150 sh -c "'$L' bench npe --device cuda --batch 512 --steps 10 --warmup 2 $npe_peer | tee '$bench/npe_cuda.txt'"
    fi
  fi
  [ "$only" = npe ] && { npe_table steps >"$md"; cat "$md"; say "done in $((SECONDS - start)) s; log $log"; return 0; }
  if [ "$only" != snn ]; then
    # The N-body on the GPU: its tests, then the FMM (order 6) at 1e6 and 1e7 beside the CPU FMM.
    local nbody_skip=()
    command -v mpirun >/dev/null || nbody_skip=(--skip two_mpi_ranks --skip no_adapter_ends)
    [ -x "$work/tests/nbody_gpu" ] && step "test nbody_gpu" 120 "$work/tests/nbody_gpu" --test-threads=1 "${nbody_skip[@]}"
    [ -x "$work/tests/nbody_unit" ] && step "test nbody_unit (device tree and walk)" 60 "$work/tests/nbody_unit" fmm_gpu::
    step "bench nbody gpu" 240 sh -c "'$L' bench nbody --device gpu --sizes 1000000,10000000 --direct-sizes 100000 --repeats 2 | tee '$bench/nbody_gpu.txt'"
    # 1 and 2 ranks (thread ranks) sharing the one GPU: the sharded FMM at 2e6 particles.
    step "bench nbody gpu ranks" 120 sh -c "'$L' bench nbody --device gpu --ranks 1,2 --n 2000000 --repeats 2 | tee '$bench/nbody_gpu_ranks.txt'"
    # The jz-fmm example at 2e6 particles, 4 steps: the particles stay on the GPU between steps.
    mkdir -p "$out/nbody_clumps" && cp "$repo/examples/nbody_clumps/config.gpu.json" "$out/nbody_clumps/"
    step "nbody clumps on the GPU" 120 sh -c "'$L' nbody '$out/nbody_clumps/config.gpu.json' --n 2000000 --steps 4 | tee '$bench/nbody_sim.txt'"
    # The GPU FMM alone at N = 1e8 (about 90 GB of device memory at its peak, the walk's
    # sort: an H200, not an H100); accuracy on 200 targets against direct sums in f64.
    step "bench nbody gpu 1e8" 240 sh -c "'$L' bench nbody --device gpu --sizes 100000000 --direct-sizes 0 --repeats 2 --no-cpu-fmm --no-fmm3d | tee '$bench/nbody_gpu_1e8.txt'"
  fi
  [ "$only" = nbody ] && { cat "$bench/nbody_gpu.txt" "$bench/nbody_gpu_1e8.txt" >"$md" 2>/dev/null; cat "$md"; say "done in $((SECONDS - start)) s; log $log"; return 0; }
  local t
  for t in device gpu_engine edge_cases_every_engine; do
    [ -x "$work/tests/$t" ] && step "test $t" 240 "$work/tests/$t" --test-threads=1
  done
  [ -x "$work/tests/snn_unit" ] && step "test snn_unit (32-bit kernels)" 60 "$work/tests/snn_unit" the_32_bit_kernels
  local skip=()
  command -v mpirun >/dev/null || skip=(--skip two_mpi_ranks --skip a_rank_without)
  step "test gpu_train" 240 "$work/tests/gpu_train" --test-threads=1 "${skip[@]}"

  cd "$repo" || exit 1
  step "build tenth-scale V1" 60 "$L" build-network examples/v1_scale/network_recipe.tenth.json \
    --output examples/v1_scale/tenth --overwrite
  if [ "${GPU_CHECK_SKIP_FULL:-0}" != 1 ]; then
    step "build full V1" 120 "$L" build-network examples/v1_scale/network_recipe.json \
      --output examples/v1_scale/full --overwrite
  fi
  # The PyTorch peer runs in the same invocation when python3 has torch, numpy and h5py.
  local peer=""
  python3 -c 'import torch, numpy, h5py' 2>/dev/null && peer="--python python3"
  step "bench 300-cell gpu" 150 sh -c "'$L' bench bptt --config examples/glif_all2all/config.gpu.json --device gpu --repeats 5 --warmup 1 --check-cpu 4 $peer | tee '$bench/300_gpu.txt'"
  step "bench 300-cell cpu" 120 sh -c "'$L' bench bptt --config examples/glif_all2all/config.gpu.json --device cpu --repeats 3 --warmup 1 | tee '$bench/300_cpu.txt'"
  step "bench tenth gpu" 150 sh -c "'$L' bench bptt --config examples/v1_scale/config.train.tenth.json --device gpu --repeats 3 --warmup 1 --check-cpu 2 $peer | tee '$bench/tenth_gpu.txt'"
  step "bench tenth cpu" 90 sh -c "'$L' bench bptt --config examples/v1_scale/config.train.tenth.json --device cpu --repeats 1 --warmup 0 | tee '$bench/tenth_cpu.txt'"
  if [ "${GPU_CHECK_SKIP_FULL:-0}" != 1 ]; then
    step "bench full V1 gpu" 200 sh -c "'$L' bench bptt --config examples/v1_scale/config.train.json --device gpu --repeats 2 --warmup 1 | tee '$bench/full_gpu.txt'"
  fi
  # 2 thread replicas sharing the GPU against 1 replica, 3 updates each (samples/s).
  python3 - "$repo" "$work" <<'EOF'
import json, sys
repo, work = sys.argv[1], sys.argv[2]
ex = f"{repo}/examples/glif_all2all"
base = json.load(open(f"{ex}/config.gpu.json"))
base["network"] = f"{ex}/config.circuit.json"
base["training"]["losses"][0]["firing_rate"] = f"{ex}/target_rates.csv"
base.pop("manifest", None)
for name, dist in [("one", None), ("two", {"strategy": "threads", "global_batch_size": 32})]:
    c = json.loads(json.dumps(base))
    if dist:
        c["run"]["distribution"] = dist
    c["output"] = {"output_dir": f"{work}/runs/{name}", "overwrite_output_dir": True}
    json.dump(c, open(f"{work}/share_{name}.json", "w"))
EOF
  step "train 1 replica on the GPU" 90 sh -c "'$L' train '$work/share_one.json' --updates 3 | tee '$bench/share_one.txt'"
  step "train 2 thread replicas sharing the GPU" 90 sh -c "'$L' train '$work/share_two.json' --updates 3 | tee '$bench/share_two.txt'"
  # The table.
  {
    echo "# lockstep GPU check, commit $commit"
    echo
    head -3 "$log" | sed 's/^/    /'
    echo
    echo "| run | s/step | split | device memory | bandwidth | vs CPU engine |"
    echo "|---|---|---|---|---|---|"
    local f
    for f in 300_gpu 300_cpu tenth_gpu tenth_cpu full_gpu; do
      [ -f "$bench/$f.txt" ] || continue
      python3 - "$bench/$f.txt" "$f" <<'EOF'
import re, sys
text, name = open(sys.argv[1]).read(), sys.argv[2]
m = re.search(r"([\d.]+) s/step = forward ([\d.]+) \+ recompute ([\d.]+) \+ backward ([\d.]+)", text)
mem = re.search(r"device memory ([\d.]+ GiB)", text)
bw = re.search(r"arrays at ([\d.]+ GB/s).*copy of them ([\d.]+ GB/s)", text)
chk = re.search(r"steps: ([\d.]+%) of .*relative L2 ([^\n]*)", text)
cells = [name,
         m.group(1) if m else "n/a",
         f"fwd {m.group(2)} + bwd {m.group(4)}" if m else "",
         mem.group(1) if mem else "",
         f"{bw.group(1)} (copy {bw.group(2)})" if bw else "",
         f"{chk.group(1)} spikes agree; grad {chk.group(2)}" if chk else ""]
print("| " + " | ".join(cells) + " |")
EOF
    done
    for f in share_one share_two; do
      [ -f "$bench/$f.txt" ] && echo "| $f | $(grep -o '[0-9.]* samples/s' "$bench/$f.txt" | tail -1) | | | | |"
    done
    grep -h "PyTorch" "$bench"/*.txt 2>/dev/null | sed 's/^ */    /'
    echo
    npe_table
    echo "Steps:"
    grep '^== ' "$log" | sed 's/^== /- /'
  } >"$md"
  cat "$md"
  say "done in $((SECONDS - start)) s; log $log"
}

# The NPE lines of the table (bench npe on gpu and cuda), from $bench; uses $commit, $log.
npe_table() {
  echo "# lockstep NPE on the GPU, commit $commit"
  echo
  local f
  for f in npe_gpu npe_cuda; do
    [ -f "$bench/$f.txt" ] || continue
    echo "## $f"
    echo
    grep -E "^device:|s/step|kernel launches|device memory|torch |PyTorch|note:" "$bench/$f.txt" | sed 's/^ */    /'
    echo
  done
  if [ "${1:-}" = steps ]; then
    echo "Steps:"
    grep '^== ' "$log" | sed 's/^== /- /'
  fi
}

case ${1:-} in
  bundle) shift; bundle "$@" ;;
  run) shift; run "$@" ;;
  *) die "usage: gpu-check.sh bundle [TARBALL] | run TARBALL OUTDIR" ;;
esac
