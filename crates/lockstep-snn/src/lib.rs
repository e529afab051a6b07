//! `lockstep-snn`: GLIF3 / LIF point-neuron networks for lockstep.
//!
//! What this crate guarantees:
//! * **NEST-exact forward dynamics** of `nest:glif_psc` (GLIF1/GLIF3) and
//!   `nest:iaf_psc_alpha` on NEST's time grid (`docs/neuron-models.md`, NEST 3.x sources): the
//!   same spikes, at the same steps, as NEST for the same network and inputs
//!   (`tests/reference_point450.rs`).
//! * **Reproducible trials:** trials are independent and batched `[batch, neuron]`; Poisson
//!   inputs are drawn per (seed, global sample index, node, step), so results do not depend
//!   on the thread count, the batch split or the replica count.
//! * **Exact gradients of the surrogate model:** BPTT is the hand-written adjoint of the very
//!   forward recursion the simulator runs; segmented recompute (`gradient_checkpointing`)
//!   gives bitwise the same gradients; the single-step update is generic over [`Scalar`]
//!   (f32, f64, `num_dual::Dual64`) so a dual-number oracle checks them.
//! * **Fast float32 training** (`run.dtype: float32`): batch-innermost kernels whose forward
//!   pass is bitwise the per-sample float32 one and whose gradient matches it to 1e-5
//!   relative L2, bitwise independent of the thread count (`tests/bptt_float32.rs`).
//! * **Bad input is refused, not guessed:** unsupported models, parameters, receptors, delays
//!   and config keys are errors ([`SnnError`]) naming the node type, edge, file or key.
//!
//! Layout: two compute paths as folders, shared pieces beside them.
//! * `simulation/`: the NEST-exact float64 simulation (cell models, NEST's propagators and
//!   time grid, one neuron's step, the forward recursion and its kernel, `lockstep simulate`).
//! * `training/`: BPTT ([`SnnModel`], its options, the per-sample float64 reference and
//!   gradient oracle, and the float32 CPU engine in `training/cpu_f32/`). The engine is chosen
//!   once, in [`SnnModel::new`].
//! * Shared: networks in CSR form per presynaptic source grouped by delay and receptor port
//!   (`network`), inputs (`input`), losses (`loss`), the numbers the step runs on and the
//!   surrogate (`scalar`), errors, config reading (`config`), the SONATA adapter (`sonata`)
//!   and the trainer's replica (`replica`). Every public item is re-exported here, at one path.

mod all_to_all;
mod config;
mod error;
mod input;
mod loss;
mod network;
mod replica;
mod scalar;
mod simulation;
mod sonata;
mod train_job;
mod trained_simulation;
mod training;

pub use all_to_all::all_to_all_glif3;
pub use config::{
    loss_names, model_from_config, model_from_config_on, model_from_config_on_device,
    GradientCheckpointing, InputSection, SnnOutput, SnnRun, SnnTrainConfig, SnnTraining,
    TrainingSpikes, TRAINING_SPIKES_DIR,
};
pub use error::{Result, SnnError};
pub use input::{InputSpec, Inputs, PoissonSpec};
pub use loss::{Loss, LossesSection, RateTarget, RateUnits};
pub use network::{
    CellType, Csr, EdgeSpec, Group, Network, NetworkSpec, NeuronSpec, Segment, VirtualNodeSpec,
};
pub use replica::{PoissonTrials, SnnReplica};
pub use scalar::{PseudoDerivative, Scalar, Surrogate, SurrogateSection, SurrogateSpec};
pub use simulation::config::{
    firing_rates, simulate_config, RateGroup, RateRow, ReportSummary, RunProgress, SimulateOptions,
    SimulationConfig, SimulationOutput, SimulationRun, SimulationSummary,
};
pub use simulation::forward::{
    simulate, simulate_with, SimExtras, SimOptions, SimOutput, TrialSpikes, TrialState, VmRecorder,
    PROGRESS_CHUNK,
};
pub use simulation::model::{
    AscConsts, CellConsts, CellModel, GlifParams, IafPscAlphaParams, InitialState, ModelKind,
    PortConsts, ReceptorError,
};
pub use simulation::nest::{TimeGrid, TICS_PER_MS};
pub use sonata::{
    export_trained_weights, network_spec_from_circuit, spike_trains_for_virtual_nodes,
};
pub use train_job::{asks_for_gpu, check_config, prepare, train_config, Overrides};
pub use trained_simulation::{write_trained_simulation_config, TRAINED_SIMULATION_CONFIG};
pub use training::{
    BpttOptions, DeviceCounts, DeviceRequest, Dtype, LossAndGrad, SnnModel, SpmvForm, StepTiming,
    SCATTER_BLOCK,
};
