//! With the `mpi` feature: compiles `csrc/mpi_constants.c` against the MPI library that rsmpi
//! links (found the same way, through `build-probe-mpi`), to export `MPI_IN_PLACE`.

fn main() {
    println!("cargo:rerun-if-changed=csrc/mpi_constants.c");
    #[cfg(feature = "mpi")]
    compile_mpi_constants();
}

/// The build dependencies `cc` and `build-probe-mpi` exist only with the `mpi` feature.
#[cfg(feature = "mpi")]
fn compile_mpi_constants() {
    let lib = build_probe_mpi::probe().unwrap_or_else(|errs| {
        let reasons: Vec<String> = errs.iter().map(|e| e.to_string()).collect();
        panic!(
            "lockstep-comm (feature `mpi`) needs an MPI library (Open MPI or MPICH with mpicc); \
             install libopenmpi-dev or build without default features. Probes: {}",
            reasons.join("; ")
        )
    });
    let mut build = cc::Build::new();
    build.file("csrc/mpi_constants.c");
    match lib.mpicc {
        Some(mpicc) => {
            build.compiler(mpicc);
        }
        None => {
            for inc in &lib.include_paths {
                build.include(inc);
            }
        }
    }
    build.compile("lockstep_mpi_constants");
}
