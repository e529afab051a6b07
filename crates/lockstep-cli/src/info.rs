//! `lockstep info`: the launch environment, device binding and version of every rank.

use anyhow::Result;
use lockstep_comm::CommExt;
use lockstep_comm::World;

/// Bytes reserved per rank for its info line in the gather.
const LINE: usize = 512;

/// Gathers one line per rank to the chief, which prints them in rank order.
pub fn run(world: &World) -> Result<()> {
    let comm = world.comm();
    let host = &world.host;
    let line = format!(
        "rank {}/{}: launch {}, device {}, host {host}, pid {}",
        comm.rank(),
        comm.size(),
        world.launch,
        world.device,
        std::process::id()
    );
    let mut mine = [0u8; LINE];
    let n = line.len().min(LINE);
    mine[..n].copy_from_slice(&line.as_bytes()[..n]);
    let mut all = if comm.is_chief() {
        vec![0u8; LINE * comm.size()]
    } else {
        Vec::new()
    };
    comm.gather(&mine, &mut all, 0)?;
    if comm.is_chief() {
        println!("lockstep {}", env!("CARGO_PKG_VERSION"));
        println!(
            "communicator: {} with {} rank(s){}",
            comm.backend(),
            comm.size(),
            mpi_library()
        );
        for chunk in all.chunks(LINE) {
            let end = chunk.iter().position(|&b| b == 0).unwrap_or(LINE);
            println!("{}", String::from_utf8_lossy(&chunk[..end]));
        }
        print_adapters();
    }
    Ok(())
}

/// The GPU adapters wgpu sees on this host (what `run.device: "gpu:N"` counts), or why
/// there are none.
fn print_adapters() {
    let adapters = lockstep_gpu::process_adapters();
    if adapters.is_empty() {
        println!(
            "GPU adapters: none (install a Vulkan driver and libvulkan1; without a GPU, mesa-vulkan-drivers gives the software adapter lavapipe)"
        );
        return;
    }
    println!("GPU adapters (run.device \"gpu:N\"; \"gpu\" binds the node-local rank's):");
    for a in adapters {
        println!("  {a}");
    }
    match lockstep_gpu::hidden_features() {
        Ok(f) if f.is_empty() => {}
        Ok(f) => println!(
            "  ({} hides {f} on every adapter)",
            lockstep_gpu::HIDE_FEATURES_VAR
        ),
        Err(e) => println!("  ({e}; a GPU run stops on it)"),
    }
}

#[cfg(feature = "mpi")]
fn mpi_library() -> String {
    let v = lockstep_comm::MpiComm::library_version();
    let first = v
        .lines()
        .next()
        .unwrap_or("")
        .trim_matches(|c: char| c.is_whitespace() || c == '\0')
        .to_string();
    if first.is_empty() {
        String::new()
    } else {
        format!(" ({first})")
    }
}

#[cfg(not(feature = "mpi"))]
fn mpi_library() -> String {
    " (built without MPI)".into()
}
