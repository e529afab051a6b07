//! The one-rank communicator of a serial run.

use crate::{check_counts, check_root, CommError, Communicator, ReduceBuf, ReduceOp};

/// A group of exactly one rank (rank 0, the chief). Collectives are no-ops or local copies,
/// so code written against [`Communicator`] runs unchanged as a serial program.
#[derive(Debug, Default, Clone, Copy)]
pub struct SelfComm;

impl SelfComm {
    /// The one-rank group.
    pub fn new() -> Self {
        SelfComm
    }
}

fn same_len(op: &'static str, want: usize, got: usize) -> Result<(), CommError> {
    if want != got {
        return Err(CommError::InvalidArgument {
            op,
            rank: 0,
            detail: format!("receive buffer holds {got} bytes but {want} are expected"),
        });
    }
    Ok(())
}

impl Communicator for SelfComm {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn backend(&self) -> &'static str {
        "self"
    }
    fn barrier(&self) -> Result<(), CommError> {
        Ok(())
    }
    fn broadcast_bytes(&self, _buf: &mut [u8], root: usize) -> Result<(), CommError> {
        check_root("broadcast", 0, 1, root)
    }
    fn all_reduce_buf(&self, _buf: ReduceBuf<'_>, _op: ReduceOp) -> Result<(), CommError> {
        Ok(())
    }
    fn gather_bytes(&self, send: &[u8], recv: &mut [u8], root: usize) -> Result<(), CommError> {
        check_root("gather", 0, 1, root)?;
        same_len("gather", send.len(), recv.len())?;
        recv.copy_from_slice(send);
        Ok(())
    }
    fn scatter_bytes(&self, send: &[u8], recv: &mut [u8], root: usize) -> Result<(), CommError> {
        check_root("scatter", 0, 1, root)?;
        same_len("scatter", recv.len(), send.len())?;
        recv.copy_from_slice(send);
        Ok(())
    }
    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> Result<(), CommError> {
        same_len("all_gather", send.len(), recv.len())?;
        recv.copy_from_slice(send);
        Ok(())
    }
    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut Vec<u8>,
    ) -> Result<Vec<usize>, CommError> {
        check_counts(0, 1, send, send_counts)?;
        recv.clear();
        recv.extend_from_slice(send);
        Ok(vec![send.len()])
    }
    fn abort(&self, code: i32) -> ! {
        crate::eprint_flush(&format!(
            "lockstep: rank 0 aborted the job (exit code {code})"
        ));
        std::process::exit(code)
    }
}
