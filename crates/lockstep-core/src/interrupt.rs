//! Cooperative interruption (Ctrl-C) of long library calls.
//!
//! One process-wide flag. A front end that wants Ctrl-C to stop a call cleanly (the Python
//! package: `KeyboardInterrupt`) sets it from its signal handler with [`request`] (an atomic
//! store: async-signal-safe) and clears it with [`clear`] when the call has returned. The
//! libraries poll it with [`requested`] at points where stopping leaves nothing half done:
//!
//! - training (`lockstep-train`'s engine): after each update; the ranks agree through the
//!   update's metrics reduction, so every replica stops after the same update, and the chief
//!   writes a checkpoint there first (`--resume` continues exactly);
//! - the spiking-network simulation: every chunk of steps; nothing is written;
//! - the N-body: between the phases of a force evaluation and before every step; the
//!   snapshots already written stay.
//!
//! Nothing sets the flag unless a front end asks: the `lockstep` command keeps the default
//! Ctrl-C behaviour (the process ends).

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

/// Asks the running library calls to stop at their next check. Async-signal-safe.
pub fn request() {
    REQUESTED.store(true, Ordering::SeqCst);
}

/// Whether a stop was asked for (and not yet [`clear`]ed).
pub fn requested() -> bool {
    REQUESTED.load(Ordering::SeqCst)
}

/// Forgets a request (the front end, after the interrupted call returned).
pub fn clear() {
    REQUESTED.store(false, Ordering::SeqCst);
}

/// The error of a call stopped by [`request`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("interrupted (Ctrl-C)")]
pub struct Interrupted;

/// `Err(Interrupted)` when a stop was asked for.
///
/// Errors: [`Interrupted`].
pub fn check() -> Result<(), Interrupted> {
    if requested() {
        Err(Interrupted)
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_is_seen_until_cleared() {
        clear();
        assert_eq!(check(), Ok(()));
        request();
        assert!(requested());
        assert_eq!(check(), Err(Interrupted));
        clear();
        assert!(!requested());
    }
}
