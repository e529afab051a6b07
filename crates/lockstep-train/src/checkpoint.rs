//! Complete, portable checkpoints (invariant 10).
//!
//! One `safetensors` file per checkpoint: tensors `trainable`, `frozen`, `optimizer.slot{i}`;
//! metadata (safetensors' `__metadata__` string map) with the format, the update counter, the
//! next global sample index and seed (the whole RNG state: every random stream is keyed by
//! them), the optimizer step, the config hash, and a SHA-256 over all tensors and metadata.
//! Written atomically by the chief (temp file in the same directory, fsync, rename); a file
//! whose checksum does not match is refused. The state does not depend on the replica count,
//! so a checkpoint restores on any number of replicas.

use crate::optim::{Optimizer, PlateauState};
use crate::TrainError;
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

const FORMAT: &str = "lockstep-checkpoint-1";

/// Everything a training run needs to continue exactly where it stopped.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainState {
    /// Optimizer updates completed.
    pub update: u64,
    /// Global index of the next sample to draw.
    pub next_sample: u64,
    /// `run.seed`.
    pub seed: u64,
    /// Trainable parameters.
    pub trainable: Vec<f32>,
    /// Frozen parameters.
    pub frozen: Vec<f32>,
    /// Optimizer step counter and state buffers.
    pub optimizer_step: u64,
    /// Optimizer state buffers (Adam: m, v; SGD: velocity).
    pub optimizer_slots: Vec<Vec<f32>>,
    /// The reduce-on-plateau state (`None` in checkpoints written before it existed).
    pub plateau: Option<PlateauState>,
    /// The loss scaler's state of a mixed-precision run (`None` without `training.grad_scaler`
    /// and in checkpoints written before it existed).
    pub grad_scaler: Option<crate::grad_scaler::GradScalerState>,
    /// Hash of the config parts that define the model and its training (see
    /// [`crate::engine::config_hash`]).
    pub config_hash: String,
}

impl TrainState {
    /// Copies the optimizer's counters and buffers into the state.
    pub fn set_optimizer(&mut self, opt: &Optimizer) {
        self.optimizer_step = opt.step;
        self.optimizer_slots = opt.slots.clone();
        self.plateau = Some(opt.plateau);
    }
}

fn digest(tensors: &BTreeMap<String, Vec<f32>>, meta: &BTreeMap<String, String>) -> String {
    let mut h = Sha256::new();
    for (name, data) in tensors {
        h.update(name.as_bytes());
        h.update((data.len() as u64).to_le_bytes());
        for v in data {
            h.update(v.to_le_bytes());
        }
    }
    for (k, v) in meta {
        if k != "sha256" {
            h.update(k.as_bytes());
            h.update([0]);
            h.update(v.as_bytes());
            h.update([0]);
        }
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn tensors_of(state: &TrainState) -> BTreeMap<String, Vec<f32>> {
    let mut t = BTreeMap::new();
    t.insert("trainable".to_string(), state.trainable.clone());
    t.insert("frozen".to_string(), state.frozen.clone());
    for (i, s) in state.optimizer_slots.iter().enumerate() {
        t.insert(format!("optimizer.slot{i}"), s.clone());
    }
    t
}

/// Writes `state` to `path` atomically (temp file + fsync + rename).
///
/// Errors: [`TrainError::Io`] naming the file, [`TrainError::Checkpoint`] when the state
/// cannot be serialized.
pub fn write(path: &Path, state: &TrainState) -> Result<(), TrainError> {
    let tensors = tensors_of(state);
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), FORMAT.to_string());
    meta.insert("update".to_string(), state.update.to_string());
    meta.insert("next_sample".to_string(), state.next_sample.to_string());
    meta.insert("seed".to_string(), state.seed.to_string());
    meta.insert(
        "optimizer_step".to_string(),
        state.optimizer_step.to_string(),
    );
    meta.insert(
        "optimizer_slots".to_string(),
        state.optimizer_slots.len().to_string(),
    );
    meta.insert("config_hash".to_string(), state.config_hash.clone());
    if let Some(p) = &state.plateau {
        // f64 bit patterns, so the state round-trips exactly (infinity included).
        meta.insert(
            "plateau".to_string(),
            format!(
                "{:x},{:x},{},{}",
                p.learning_rate.to_bits(),
                p.best.to_bits(),
                p.bad_epochs,
                p.cooldown_left
            ),
        );
    }
    if let Some(g) = &state.grad_scaler {
        // The f32 bit pattern, so the scale round-trips exactly.
        meta.insert(
            "grad_scaler".to_string(),
            format!("{:x},{},{}", g.scale.to_bits(), g.growth_tracker, g.skipped),
        );
    }
    let sum = digest(&tensors, &meta);
    meta.insert("sha256".to_string(), sum);
    let bytes: Vec<(String, Vec<u8>)> = tensors
        .iter()
        .map(|(k, v)| (k.clone(), bytemuck_bytes(v)))
        .collect();
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(k, b)| {
            TensorView::new(Dtype::F32, vec![b.len() / 4], b)
                .map(|v| (k.clone(), v))
                .map_err(|e| TrainError::Checkpoint {
                    path: path.to_path_buf(),
                    message: format!("cannot build tensor {k}: {e}"),
                })
        })
        .collect::<Result<_, _>>()?;
    let data = safetensors::serialize(views, Some(meta.into_iter().collect::<HashMap<_, _>>()))
        .map_err(|e| TrainError::Checkpoint {
            path: path.to_path_buf(),
            message: format!("cannot serialise: {e}"),
        })?;
    write_atomic(path, &data)
}

fn bytemuck_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Writes `data` to `path` through a temp file in the same directory, fsync and rename, so a
/// reader sees either the old file or the complete new one.
///
/// Errors: [`TrainError::Io`] naming the file.
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<(), TrainError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_string())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp{}", std::process::id()));
    let result = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    result.map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        TrainError::io(path, "cannot write", e)
    })
}

/// The name of the pointer file in `checkpoints/` that holds the file name of the newest
/// checkpoint.
pub const LATEST: &str = "latest";

/// The checkpoint file that `path` names, as a user passes it to `--resume`: a checkpoint
/// file itself; a [`LATEST`] pointer (a small text file holding the checkpoint's file name,
/// resolved in the pointer's folder); a `checkpoints/` folder or a run directory (its
/// pointer).
///
/// Errors: [`TrainError::Checkpoint`] when `path` does not exist, is a folder without a
/// pointer, or the pointer names a missing file.
pub fn resolve(path: &Path) -> Result<PathBuf, TrainError> {
    let bad = |p: &Path, m: String| TrainError::Checkpoint {
        path: p.to_path_buf(),
        message: m,
    };
    if path.is_dir() {
        let pointer = [path.join("checkpoints").join(LATEST), path.join(LATEST)]
            .into_iter()
            .find(|p| p.is_file())
            .ok_or_else(|| {
                bad(path, format!("is a folder without checkpoints/{LATEST}: pass a run directory, its checkpoints/{LATEST} or a checkpoint file (checkpoints/update_NNNNNN.safetensors)"))
            })?;
        return resolve(&pointer);
    }
    let meta = std::fs::metadata(path).map_err(|e| bad(path, format!("cannot read: {e}")))?;
    let pointer = path.file_name().is_some_and(|n| n == LATEST) || meta.len() < 256;
    if !pointer {
        return Ok(path.to_path_buf());
    }
    let Ok(name) = std::fs::read_to_string(path) else {
        return Ok(path.to_path_buf()); // binary: a (possibly damaged) checkpoint
    };
    let name = name.trim();
    if name.is_empty() || name.contains(['/', '\\']) || !name.ends_with(".safetensors") {
        return Ok(path.to_path_buf());
    }
    let target = path.parent().unwrap_or(Path::new(".")).join(name);
    if !target.is_file() {
        return Err(bad(
            path,
            format!("points to {name}, which does not exist next to it"),
        ));
    }
    Ok(target)
}

/// Reads and verifies a checkpoint.
///
/// Errors: [`TrainError::Checkpoint`] when the file is missing, not a lockstep checkpoint,
/// truncated, or its SHA-256 does not match (a flipped byte).
pub fn read(path: &Path) -> Result<TrainState, TrainError> {
    let bad = |m: String| TrainError::Checkpoint {
        path: path.to_path_buf(),
        message: m,
    };
    let data = std::fs::read(path).map_err(|e| bad(format!("cannot read: {e}")))?;
    let st = SafeTensors::deserialize(&data).map_err(|e| {
        bad(format!(
            "not a readable safetensors file ({e}); it is damaged or not a checkpoint"
        ))
    })?;
    let (_, header) =
        SafeTensors::read_metadata(&data).map_err(|e| bad(format!("unreadable header: {e}")))?;
    let meta: BTreeMap<String, String> = header
        .metadata()
        .clone()
        .ok_or_else(|| bad("no metadata: not a lockstep checkpoint".into()))?
        .into_iter()
        .collect();
    if meta.get("format").map(String::as_str) != Some(FORMAT) {
        return Err(bad(format!(
            "format {:?} is not {FORMAT:?}: not a lockstep checkpoint",
            meta.get("format")
        )));
    }
    let mut tensors = BTreeMap::new();
    for (name, view) in st.tensors() {
        if view.dtype() != Dtype::F32 {
            return Err(bad(format!(
                "tensor {name} is {:?}, expected F32",
                view.dtype()
            )));
        }
        let v: Vec<f32> = view
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        tensors.insert(name, v);
    }
    let want = meta.get("sha256").cloned().unwrap_or_default();
    let got = digest(&tensors, &meta);
    if want != got {
        return Err(bad(format!(
            "checksum mismatch (stored {want}, computed {got}): the file is corrupted; use an earlier checkpoint"
        )));
    }
    let num = |k: &str| -> Result<u64, TrainError> {
        meta.get(k)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad(format!("metadata {k} missing or not a number")))
    };
    let slots = num("optimizer_slots")? as usize;
    let mut take = |k: &str| -> Result<Vec<f32>, TrainError> {
        tensors
            .remove(k)
            .ok_or_else(|| bad(format!("tensor {k} missing")))
    };
    Ok(TrainState {
        update: num("update")?,
        next_sample: num("next_sample")?,
        seed: num("seed")?,
        trainable: take("trainable")?,
        frozen: take("frozen")?,
        optimizer_step: num("optimizer_step")?,
        optimizer_slots: (0..slots)
            .map(|i| take(&format!("optimizer.slot{i}")))
            .collect::<Result<_, _>>()?,
        config_hash: meta.get("config_hash").cloned().unwrap_or_default(),
        plateau: match meta.get("plateau") {
            None => None,
            Some(text) => Some(
                parse_plateau(text)
                    .ok_or_else(|| bad(format!("metadata plateau {text:?} is malformed")))?,
            ),
        },
        grad_scaler: match meta.get("grad_scaler") {
            None => None,
            Some(text) => Some(
                parse_grad_scaler(text)
                    .ok_or_else(|| bad(format!("metadata grad_scaler {text:?} is malformed")))?,
            ),
        },
    })
}

/// `scale_bits,growth_tracker,skipped` (hex f32 bits, decimal counts).
fn parse_grad_scaler(text: &str) -> Option<crate::grad_scaler::GradScalerState> {
    let parts: Vec<&str> = text.split(',').collect();
    let [scale, tracker, skipped] = parts.as_slice() else {
        return None;
    };
    let scale = f32::from_bits(u32::from_str_radix(scale, 16).ok()?);
    (scale > 0.0 && scale.is_finite()).then_some(())?;
    Some(crate::grad_scaler::GradScalerState {
        scale,
        growth_tracker: tracker.parse().ok()?,
        skipped: skipped.parse().ok()?,
    })
}

/// `learning_rate_bits,best_bits,bad_epochs,cooldown_left` (hex f64 bits, decimal counts).
fn parse_plateau(text: &str) -> Option<PlateauState> {
    let parts: Vec<&str> = text.split(',').collect();
    let [lr, best, bad, cooldown] = parts.as_slice() else {
        return None;
    };
    Some(PlateauState {
        learning_rate: f64::from_bits(u64::from_str_radix(lr, 16).ok()?),
        best: f64::from_bits(u64::from_str_radix(best, 16).ok()?),
        bad_epochs: bad.parse().ok()?,
        cooldown_left: cooldown.parse().ok()?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> TrainState {
        TrainState {
            update: 4,
            next_sample: 64,
            seed: 7,
            trainable: vec![1.0, -2.5, 3.25],
            frozen: vec![0.5],
            optimizer_step: 4,
            optimizer_slots: vec![vec![0.1, 0.2, 0.3], vec![1e-3, 2e-3, 3e-3]],
            config_hash: "abc".into(),
            plateau: Some(PlateauState {
                learning_rate: 0.1 / 3.0,
                best: f64::INFINITY,
                bad_epochs: 2,
                cooldown_left: 1,
            }),
            grad_scaler: Some(crate::grad_scaler::GradScalerState {
                scale: 1.0 / 3.0,
                growth_tracker: 17,
                skipped: 2,
            }),
        }
    }

    #[test]
    fn round_trip_is_exact() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.safetensors");
        write(&p, &state()).unwrap();
        assert_eq!(read(&p).unwrap(), state());
    }

    #[test]
    fn resume_paths_resolve_to_the_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let ckpts = dir.path().join("checkpoints");
        std::fs::create_dir_all(&ckpts).unwrap();
        let file = ckpts.join("update_000004.safetensors");
        write(&file, &state()).unwrap();
        write_atomic(&ckpts.join(LATEST), b"update_000004.safetensors").unwrap();
        for p in [dir.path(), &ckpts, &ckpts.join(LATEST), &file] {
            assert_eq!(resolve(p).unwrap(), file, "{}", p.display());
        }
        assert_eq!(read(&resolve(dir.path()).unwrap()).unwrap(), state());
        let e = resolve(&dir.path().join("nothing"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("nothing") && e.contains("cannot read"), "{e}");
        let empty = tempfile::tempdir().unwrap();
        let e = resolve(empty.path()).unwrap_err().to_string();
        assert!(e.contains("without checkpoints/latest"), "{e}");
        write_atomic(&ckpts.join(LATEST), b"update_000009.safetensors").unwrap();
        let e = resolve(dir.path()).unwrap_err().to_string();
        assert!(e.contains("update_000009.safetensors"), "{e}");
    }

    #[test]
    fn every_flipped_byte_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.safetensors");
        write(&p, &state()).unwrap();
        let good = std::fs::read(&p).unwrap();
        for i in (0..good.len()).step_by(7) {
            let mut bad = good.clone();
            bad[i] ^= 0x10;
            std::fs::write(&p, &bad).unwrap();
            let r = read(&p);
            // A flip inside JSON whitespace can leave the content intact; everything else must fail.
            if let Ok(s) = r {
                assert_eq!(
                    s,
                    state(),
                    "byte {i} flipped and accepted with different content"
                );
            }
        }
        let mut bad = good.clone();
        let n = bad.len();
        bad[n - 3] ^= 0x01; // inside the tensor data
        std::fs::write(&p, &bad).unwrap();
        let e = read(&p).unwrap_err().to_string();
        assert!(
            e.contains("checksum mismatch") && e.contains("c.safetensors"),
            "{e}"
        );
    }
}
