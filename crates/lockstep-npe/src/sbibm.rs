//! Reference posteriors of the SBI benchmark (sbibm, Lueckmann et al. 2021) for the tasks
//! `two_moons` and `slcp`, observations 1-3: the observation, the parameters it was
//! simulated from, and 10,000 reference posterior samples, compiled in from
//! `crates/lockstep-npe/data/sbibm` (MIT licence and provenance there).

use crate::error::NpeError;

/// The observation numbers bundled for each task.
pub const OBSERVATIONS: [usize; 3] = [1, 2, 3];

/// The tasks bundled.
pub const TASKS: [&str; 2] = ["two_moons", "slcp"];

/// One sbibm observation with its reference posterior.
#[derive(Debug, Clone, PartialEq)]
pub struct Reference {
    /// Task name (`two_moons` or `slcp`).
    pub task: String,
    /// sbibm's observation number.
    pub observation: usize,
    /// The observed data x `[x_dim]`.
    pub x: Vec<f32>,
    /// The parameters x was simulated from `[theta_dim]`.
    pub true_theta: Vec<f32>,
    /// Reference posterior samples `[n * theta_dim]` row-major.
    pub samples: Vec<f32>,
    /// θ components.
    pub theta_dim: usize,
}

macro_rules! files {
    ($task:literal, $n:literal) => {
        (
            $task,
            $n,
            include_str!(concat!(
                "../data/sbibm/",
                $task,
                "/num_observation_",
                $n,
                "/observation.csv"
            )),
            include_str!(concat!(
                "../data/sbibm/",
                $task,
                "/num_observation_",
                $n,
                "/true_parameters.csv"
            )),
            include_bytes!(concat!(
                "../data/sbibm/",
                $task,
                "/num_observation_",
                $n,
                "/reference_posterior_samples.npy"
            )) as &[u8],
        )
    };
}

type Files = (
    &'static str,
    usize,
    &'static str,
    &'static str,
    &'static [u8],
);

const FILES: [Files; 6] = [
    files!("two_moons", 1),
    files!("two_moons", 2),
    files!("two_moons", 3),
    files!("slcp", 1),
    files!("slcp", 2),
    files!("slcp", 3),
];

/// The values of the one data row of an sbibm CSV file (a header line, then one row).
fn csv_row(text: &str, what: &str) -> Result<Vec<f32>, NpeError> {
    let row = text
        .lines()
        .nth(1)
        .ok_or_else(|| NpeError::Data(format!("{what}: no data row")))?;
    row.split(',')
        .map(|v| {
            v.trim()
                .parse::<f32>()
                .map_err(|e| NpeError::Data(format!("{what}: `{v}` is not a number ({e})")))
        })
        .collect()
}

/// The reference data of `task` (`two_moons`, `slcp`) and sbibm observation `observation`.
///
/// Errors: a task or observation that is not bundled (the message lists those that are).
pub fn reference(task: &str, observation: usize) -> Result<Reference, NpeError> {
    let Some(&(_, _, obs, truth, npy)) = FILES.iter().find(|f| f.0 == task && f.1 == observation)
    else {
        return Err(NpeError::Invalid(format!("no sbibm reference posterior for task `{task}` observation {observation}; bundled: tasks {TASKS:?}, observations {OBSERVATIONS:?}")));
    };
    let what = format!("sbibm {task} observation {observation}");
    let x = csv_row(obs, &format!("{what} observation.csv"))?;
    let true_theta = csv_row(truth, &format!("{what} true_parameters.csv"))?;
    let file = npyz::NpyFile::new(npy)
        .map_err(|e| NpeError::io(format!("{what}: reading the samples"), e))?;
    let shape = file.shape().to_vec();
    let samples = file
        .into_vec::<f32>()
        .map_err(|e| NpeError::io(format!("{what}: reading the samples"), e))?;
    if shape.len() != 2 || shape[1] as usize != true_theta.len() {
        return Err(NpeError::Data(format!(
            "{what}: samples of shape {shape:?}, expected [n, {}]",
            true_theta.len()
        )));
    }
    Ok(Reference {
        task: task.to_string(),
        observation,
        x,
        theta_dim: true_theta.len(),
        true_theta,
        samples,
    })
}
