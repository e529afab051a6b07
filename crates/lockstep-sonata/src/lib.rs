//! SONATA networks and spike files: read, validate, write.
//!
//! Implements the parts of the SONATA data format (Dai et al. 2020, PLoS Comput Biol 16(2):
//! e1007696; spec at github.com/AllenInstitute/sonata) that BMTK point-neuron networks use:
//!
//! - [`SonataConfig`]: circuit/simulation config JSON with `$VARIABLE` manifest, `components`,
//!   `networks`, and an included `network` circuit file;
//! - [`Circuit`]: every [`NodePopulation`] and [`EdgePopulation`] of a config, joined with
//!   their types CSVs ([`TypeTable`]) and component JSON files ([`ComponentStore`]), validated,
//!   in struct-of-arrays form (one `Vec` per column, `[node]` or `[edge]`);
//! - spike files ([`SpikeTrains`], [`read_spikes`], [`write_spikes`]);
//! - membrane reports ([`Report`], [`write_report`], [`read_report`]) and the `reports` block
//!   of a simulation config ([`membrane_reports`]);
//! - writers for nodes and edges files with BMTK's layout ([`write_nodes`], [`write_edges`]),
//!   [`rewrite_syn_weights`] for exporting trained weights, and [`read_edge_index`] for the
//!   edge lookup indices;
//! - [`builder`]: a network builder from a JSON recipe ([`builder::Recipe`],
//!   [`builder::build`], [`builder::BuiltNetwork::save`]).
//!
//! Units follow SONATA/BMTK/NEST: times and delays in ms, weights in pA (current synapses).
//!
//! What this crate guarantees:
//!
//! - **A circuit it returns is consistent:** every node and edge type id is in its types CSV,
//!   every edge names existing nodes, column lengths agree, `$VARIABLE`s resolve; anything
//!   else is a [`SonataError`] naming the file, population, dataset or key, never a panic
//!   (`tests/validation.rs`, including garbage input). Empty populations (no nodes, no
//!   edges, no group) read as libsonata reads them (`tests/empty_populations.rs`).
//! - **Per-node values are kept:** `dynamics_params` datasets of a node group override their
//!   type's values node by node, and per-edge values override the edge type's.
//! - **What it writes, BMTK and libsonata read:** nodes, edges (with both lookup indices,
//!   the node-to-ranges dataset under the spec's and BMTK's names), spikes (`sorting` as the
//!   spec's uint8 enum) and membrane reports have BMTK's layout, and read back bit for bit
//!   (`tests/round_trip.rs`, `tests/report_layout.rs`, checked in h5py); libsonata reads every
//!   spike and answers the index queries (`tests/libsonata.rs`).
//! - **The builder is deterministic:** the same recipe and seed give the same files.
//!
//! ```no_run
//! let c = lockstep_sonata::Circuit::from_config("config.simulation.json")?;
//! let v1 = c.node_population("v1").unwrap();
//! let rec = c.edge_population("v1_to_v1").unwrap();
//! let w = rec.weights(); // syn_weight * nsyns, [edge], pA
//! # Ok::<(), lockstep_sonata::SonataError>(())
//! ```

pub mod builder;
mod circuit;
mod column;
mod components;
mod config;
mod edges;
mod error;
mod nodes;
mod report;
mod spikes;
mod types_csv;
mod write;

pub use circuit::Circuit;
pub use column::{Column, ColumnData, PopulationGroup};
pub use components::{ComponentKind, ComponentStore};
pub use config::{
    Components, EdgesEntry, NodesEntry, SonataConfig, CIRCUIT_KEYS, CONFIG_DIR_MANIFEST,
};
pub use edges::{
    join_edges, read_edge_index, read_edge_parts, read_edges, EdgeIndex, EdgeIndexDirection,
    EdgeParts, EdgePopulation, EdgeTypes, SynapseModel, NODE_ID_TO_RANGES, NODE_ID_TO_RANGE_BMTK,
};
pub use error::{Result, SonataError, SonataErrorKind};
pub use nodes::{join_nodes, read_node_parts, read_nodes, NodeParts, NodePopulation, NodeTypes};
pub use report::{
    membrane_reports, node_selection, node_sets, read_report, write_report, MembraneReportSettings,
    NodeSelection, Report, ReportConfig, ReportDtype, ReportPopulation, MEMBRANE_REPORT_MODULES,
};
pub use spikes::{
    read_spikes, write_spikes, PopulationSpikes, SpikeSorting, SpikeTrains, LEGACY_POPULATION,
};
pub use types_csv::TypeTable;
pub use write::{
    build_edge_index, rewrite_syn_weights, write_edges, write_nodes, EdgesView, NodesView,
    SONATA_MAGIC, SONATA_VERSION,
};

use std::path::Path;

/// Opens an HDF5 file read-only, mapping "missing" to a clear [`SonataErrorKind::Io`].
pub(crate) fn open_h5(path: &Path, what: &str) -> Result<hdf5::File> {
    if let Err(source) = std::fs::metadata(path) {
        return Err(SonataErrorKind::Io {
            what: what.to_string(),
            path: path.to_path_buf(),
            origin: "config or argument".into(),
            cause: source,
        }
        .into());
    }
    hdf5::File::open(path).map_err(|e| SonataError::h5(path, "/", e))
}
