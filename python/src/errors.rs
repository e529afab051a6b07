//! Library errors as Python exceptions. The classes live in `lockstep/_errors.py`
//! (`LockstepError` and its subclasses, which also derive from the matching built-in:
//! `ValueError`, `FileNotFoundError`, `RuntimeError`); the message is the library's, with
//! every cause in order, as the `lockstep` command prints it (`{:#}`).

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// Which exception class an error becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Bad input: a config key, a value, an array's shape (`lockstep.InvalidInputError`, a
    /// `ValueError`).
    Invalid,
    /// A file or folder that does not exist (`lockstep.LockstepFileNotFoundError`, a
    /// `FileNotFoundError`).
    NotFound,
    /// Anything else that stopped a run (`lockstep.RunError`, a `RuntimeError`).
    Run,
}

/// An exception of class `kind` carrying `message`.
pub(crate) fn exception(kind: Kind, message: impl Into<String>) -> PyErr {
    let message = message.into();
    let class = match kind {
        Kind::Invalid => "InvalidInputError",
        Kind::NotFound => "LockstepFileNotFoundError",
        Kind::Run => "RunError",
    };
    Python::attach(|py| {
        match py.import("lockstep._errors").and_then(|m| m.getattr(class)) {
            Ok(cls) => match cls.call1((message.clone(),)) {
                Ok(e) => PyErr::from_value(e),
                Err(e) => e,
            },
            // The package's Python half is missing (the extension imported on its own).
            Err(_) => PyRuntimeError::new_err(message),
        }
    })
}

/// Bad input, naming what the user wrote.
pub(crate) fn invalid(message: impl Into<String>) -> PyErr {
    exception(Kind::Invalid, message)
}

/// The class of an error, from the causes in its chain: a missing file anywhere makes it
/// `NotFound`; a config error or an invalid value makes it `Invalid`; else `Run`.
fn kind_of(chain: &mut dyn Iterator<Item = &(dyn std::error::Error + 'static)>) -> Kind {
    use lockstep_snn::SnnError;
    use lockstep_sonata::SonataErrorKind as Sk;
    let mut kind = Kind::Run;
    for e in chain {
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::NotFound {
                return Kind::NotFound;
            }
        }
        // The SONATA reader's errors (also inside lockstep-snn's, which show them
        // transparently, so the chain does not list them on their own).
        let sonata = e
            .downcast_ref::<lockstep_sonata::SonataError>()
            .or_else(|| match e.downcast_ref::<SnnError>() {
                Some(SnnError::Sonata(s)) => Some(&**s),
                _ => None,
            });
        match sonata.map(|s| s.kind()) {
            Some(Sk::Io { cause, .. }) if cause.kind() == std::io::ErrorKind::NotFound => {
                return Kind::NotFound
            }
            Some(Sk::NetworkNotBuilt { .. }) => return Kind::NotFound,
            Some(Sk::Io { .. } | Sk::Hdf5 { .. }) | None => {}
            Some(_) => kind = Kind::Invalid,
        }
        // The engine shows the model's and its own validation errors transparently: look
        // inside them.
        match e.downcast_ref::<lockstep_train::TrainError>() {
            Some(lockstep_train::TrainError::Build(inner)) => match kind_of(&mut inner.chain()) {
                Kind::Run => {}
                k => return k,
            },
            Some(lockstep_train::TrainError::Refused(inner)) => {
                let inner: &(dyn std::error::Error + 'static) = &**inner;
                match kind_of(&mut std::iter::successors(Some(inner), |e| e.source())) {
                    Kind::Run => {}
                    k => return k,
                }
            }
            _ => {}
        }
        if let Some(lockstep_npe::NpeError::Train(t)) = e.downcast_ref::<lockstep_npe::NpeError>() {
            let inner: &(dyn std::error::Error + 'static) = t;
            match kind_of(&mut std::iter::once(inner)) {
                Kind::Run => {}
                k => return k,
            }
        }
        if matches!(
            e.downcast_ref::<SnnError>(),
            Some(
                SnnError::UnsupportedModel { .. }
                    | SnnError::InvalidParameter { .. }
                    | SnnError::InvalidDt { .. }
                    | SnnError::DelayTooShort { .. }
                    | SnnError::InvalidReceptor { .. }
                    | SnnError::InvalidNetwork(_)
                    | SnnError::InvalidInput { .. }
                    | SnnError::Config(_)
                    | SnnError::Shape(_)
            )
        ) {
            kind = Kind::Invalid;
        }
        let invalid = e.is::<lockstep_core::config::ConfigError>()
            || matches!(
                e.downcast_ref::<lockstep_npe::NpeError>(),
                Some(lockstep_npe::NpeError::Invalid(_) | lockstep_npe::NpeError::Config(_))
            )
            || matches!(
                e.downcast_ref::<lockstep_nbody::NbodyError>(),
                Some(
                    lockstep_nbody::NbodyError::Config(_)
                        | lockstep_nbody::NbodyError::InvalidParameter { .. }
                )
            )
            || matches!(
                e.downcast_ref::<lockstep_train::TrainError>(),
                Some(lockstep_train::TrainError::Config(_))
            );
        if invalid {
            kind = Kind::Invalid;
        }
    }
    kind
}

/// An `anyhow::Error` (the library's messages with their causes) as a Python exception.
pub(crate) fn from_anyhow(e: anyhow::Error) -> PyErr {
    if let Some(py_err) = e.downcast_ref::<PyErr>() {
        return Python::attach(|py| py_err.clone_ref(py));
    }
    let kind = kind_of(&mut e.chain());
    exception(kind, format!("{e:#}"))
}

/// A library error (`std::error::Error` with sources) as a Python exception.
pub(crate) fn from_error<E: std::error::Error + Send + Sync + 'static>(e: E) -> PyErr {
    from_anyhow(anyhow::Error::new(e))
}
