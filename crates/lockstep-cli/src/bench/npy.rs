//! `.npy` files exchanged with the peers' Python scripts (NumPy format 1.0, via `npyz`).

use anyhow::{Context, Result};
use std::path::Path;

/// Writes `data` (row-major, `shape`) as a `.npy` file of `T`'s dtype (`f32` or `f64`).
///
/// Errors: the file cannot be created or written (naming it).
pub fn write_npy<T>(path: &Path, data: &[T], shape: &[u64]) -> Result<()>
where
    T: npyz::AutoSerialize + Copy,
{
    use npyz::WriterBuilder;
    let ctx = || format!("writing {}", path.display());
    let f = std::io::BufWriter::new(std::fs::File::create(path).with_context(ctx)?);
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(shape)
        .writer(f)
        .begin_nd()
        .with_context(ctx)?;
    w.extend(data.iter().copied()).with_context(ctx)?;
    w.finish().with_context(ctx)
}

/// Reads a `.npy` file of `T`'s dtype as a flat row-major vector.
///
/// Errors: the file cannot be read, is not `.npy`, or holds another dtype (naming it).
pub fn read_npy<T: npyz::Deserialize>(path: &Path) -> Result<Vec<T>> {
    let ctx = || format!("reading {}", path.display());
    let bytes = std::fs::read(path).with_context(ctx)?;
    npyz::NpyFile::new(&bytes[..])
        .with_context(ctx)?
        .into_vec::<T>()
        .with_context(ctx)
}
