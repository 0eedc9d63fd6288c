//! [`LogitOps`]: the wrappers of `kernels/logits.cu`, what happens to a logits row between
//! the head and the token choice (`mlaserve_core::logits` states the rules): per-token
//! edits (logit bias and penalties), the min-p mask of sampled rows, and the raw row's
//! log-probabilities.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use mlaserve_core::{RowEdits, MAX_TOP_LOGPROBS};

use crate::error::{CudaError, Result};
use crate::gpu::Gpu;
use crate::kernels;
use crate::launch::need;

/// The logits kernels.
#[derive(Debug)]
pub struct LogitOps {
    edit: CudaFunction,
    min_p: CudaFunction,
    logprobs: CudaFunction,
}

/// Block size of the per-row kernels (`lgt::THREADS`).
const THREADS: u32 = 512;
/// Threads per block of the edit kernel (one edit each).
const EDIT_THREADS: u32 = 256;

/// The edits of `rows` (flattened batch rows, in the order of a logits buffer's rows)
/// flattened for [`LogitOps::edit`]: each edit's buffer row, token, and (bias,
/// repetition, sub).
pub fn flatten_edits(edits: &[RowEdits], rows: &[u32]) -> (Vec<i32>, Vec<i32>, Vec<f32>) {
    let (mut r, mut t, mut v) = (Vec::new(), Vec::new(), Vec::new());
    // A row may appear more than once (several draws from one row): each copy is edited.
    for e in edits {
        for (i, _) in rows.iter().enumerate().filter(|(_, &x)| x == e.row) {
            for x in &e.edits {
                r.push(i as i32);
                t.push(x.token as i32);
                v.extend_from_slice(&[x.bias, x.repetition, x.sub]);
            }
        }
    }
    (r, t, v)
}

/// The edits of one logits buffer, on the device ([`flatten_edits`] uploaded).
#[derive(Debug)]
pub struct DeviceEdits {
    pub rows: CudaSlice<i32>,
    pub tokens: CudaSlice<i32>,
    pub vals: CudaSlice<f32>,
    pub n: usize,
}

impl DeviceEdits {
    /// Uploads the edits of `rows` (none: a one-element placeholder, `n = 0`).
    pub fn upload(stream: &Arc<CudaStream>, edits: &[RowEdits], rows: &[u32]) -> Result<Self> {
        let (r, t, v) = flatten_edits(edits, rows);
        let n = r.len();
        let up_i = |x: &[i32]| stream.clone_htod(if x.is_empty() { &[0][..] } else { x });
        Ok(DeviceEdits {
            rows: up_i(&r)?,
            tokens: up_i(&t)?,
            vals: stream.clone_htod(if v.is_empty() { &[0.0f32; 3][..] } else { &v })?,
            n,
        })
    }
}

impl LogitOps {
    pub fn new(gpu: &Gpu) -> Result<Self> {
        let m = gpu.load_module(kernels::LOGITS)?;
        Ok(LogitOps {
            edit: m.load_function("logit_edit_f32")?,
            min_p: m.load_function("min_p_mask_f32")?,
            logprobs: m.load_function("logprobs_f32")?,
        })
    }

    /// Applies `e` to `logits` (`rows × vocab`, this rank's slice of the vocabulary
    /// starting at id `offset`; edits of other ids are skipped), in place.
    pub fn edit(
        &self,
        stream: &Arc<CudaStream>,
        logits: &mut CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        offset: usize,
        e: &DeviceEdits,
    ) -> Result<()> {
        const K: &str = "logit_edit_f32";
        need(K, "logits", logits.len(), rows * vocab)?;
        need(K, "rows", e.rows.len(), e.n)?;
        need(K, "tokens", e.tokens.len(), e.n)?;
        need(K, "vals", e.vals.len(), 3 * e.n)?;
        if e.n == 0 {
            return Ok(());
        }
        if e.n > i32::MAX as usize || vocab > i32::MAX as usize || offset > i32::MAX as usize {
            return Err(CudaError::shape(K, format!("{} edits over {rows} rows of {vocab}", e.n)));
        }
        let (v, off, n) = (vocab as i32, offset as i32, e.n as i32);
        let cfg = LaunchConfig {
            grid_dim: ((e.n as u32).div_ceil(EDIT_THREADS), 1, 1),
            block_dim: (EDIT_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: logit_edit_f32(logits, vocab, offset, row, tok, vals, n): thread e < n
        // reads row[e], tok[e], vals[3e..3e+3] (lengths checked: >= n, >= 3n) and writes
        // logits[row[e] * vocab + tok[e] - offset] only when tok[e] - offset is in
        // [0, vocab); row[e] < rows by `flatten_edits` (a position in the buffer's rows),
        // and logits holds rows * vocab (checked).
        unsafe {
            stream
                .launch_builder(&self.edit)
                .arg(logits)
                .arg(&v)
                .arg(&off)
                .arg(&e.rows)
                .arg(&e.tokens)
                .arg(&e.vals)
                .arg(&n)
                .launch(cfg)
        }?;
        Ok(())
    }

    /// The min-p mask of `rows` full rows: `params[2r..2r + 2]` = (temperature, min_p);
    /// rows with min_p 0 are left alone.
    pub fn min_p(
        &self,
        stream: &Arc<CudaStream>,
        logits: &mut CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        params: &CudaSlice<f64>,
    ) -> Result<()> {
        const K: &str = "min_p_mask_f32";
        need(K, "logits", logits.len(), rows * vocab)?;
        need(K, "params", params.len(), 2 * rows)?;
        if rows == 0 {
            return Ok(());
        }
        if vocab > i32::MAX as usize || rows > i32::MAX as usize {
            return Err(CudaError::shape(K, format!("{rows} rows of {vocab}")));
        }
        let v = vocab as i32;
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: min_p_mask_f32(logits, vocab, params): block r < rows reads params[2r],
        // params[2r + 1] (>= 2 rows, checked) and reads and writes logits[r * vocab..][..vocab]
        // (>= rows * vocab, checked); static shared memory only.
        unsafe { stream.launch_builder(&self.min_p).arg(logits).arg(&v).arg(params).launch(cfg) }?;
        Ok(())
    }

    /// Log-probabilities of `rows` raw full rows: `lp[r]` of id `chosen[r]`, and the
    /// `top[r]` (<= 20) most likely ids and theirs in `top_id[20r..]`, `top_lp[20r..]`
    /// (-1: none).
    #[allow(clippy::too_many_arguments)]
    pub fn logprobs(
        &self,
        stream: &Arc<CudaStream>,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        chosen: &CudaSlice<i32>,
        top: &CudaSlice<i32>,
        lp: &mut CudaSlice<f32>,
        top_id: &mut CudaSlice<i32>,
        top_lp: &mut CudaSlice<f32>,
    ) -> Result<()> {
        const K: &str = "logprobs_f32";
        let t = MAX_TOP_LOGPROBS as usize;
        need(K, "logits", logits.len(), rows * vocab)?;
        need(K, "chosen", chosen.len(), rows)?;
        need(K, "top", top.len(), rows)?;
        need(K, "lp", lp.len(), rows)?;
        need(K, "top_id", top_id.len(), rows * t)?;
        need(K, "top_lp", top_lp.len(), rows * t)?;
        if rows == 0 {
            return Ok(());
        }
        if vocab > i32::MAX as usize || rows > i32::MAX as usize {
            return Err(CudaError::shape(K, format!("{rows} rows of {vocab}")));
        }
        let v = vocab as i32;
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: logprobs_f32(logits, vocab, chosen, top, lp, top_id, top_lp): block r <
        // rows reads logits[r * vocab..][..vocab], chosen[r], top[r] and writes lp[r],
        // top_id[20r..20r + 20], top_lp[20r..20r + 20] (lengths checked above); it reads
        // logits[r * vocab + chosen[r]] only when chosen[r] is in [0, vocab).
        unsafe {
            stream
                .launch_builder(&self.logprobs)
                .arg(logits)
                .arg(&v)
                .arg(chosen)
                .arg(top)
                .arg(lp)
                .arg(top_id)
                .arg(top_lp)
                .launch(cfg)
        }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlaserve_core::LogitEdit;

    #[test]
    fn edits_flatten_to_their_buffer_rows() {
        let e = |token| LogitEdit { token, bias: 1.0, repetition: 2.0, sub: 0.5 };
        let edits = vec![RowEdits { row: 7, edits: vec![e(3), e(4)] }, RowEdits { row: 2, edits: vec![e(9)] }];
        let (r, t, v) = flatten_edits(&edits, &[2, 7]);
        assert_eq!((r, t), (vec![1, 1, 0], vec![3, 4, 9]));
        assert_eq!(v.len(), 9);
        let (r, t, _) = flatten_edits(&edits, &[7, 2, 7]);
        assert_eq!((r, t), (vec![0, 0, 2, 2, 1], vec![3, 4, 3, 4, 9]), "every copy of a row is edited");
        assert_eq!(flatten_edits(&edits, &[5]).0, Vec::<i32>::new(), "rows of other buffers are skipped");
    }
}
