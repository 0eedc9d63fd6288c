//! The head of a call: the logits rows the batch asks for, on the device, and what leaves
//! it — logits for `logit_rows`, the argmax and sampled ids (after the rows' logit edits
//! and min-p), the log-probabilities of `logprob_rows`.

use cudarc::driver::CudaSlice;
use mlaserve_core::{Batch, RowLogprobs, SampleRow, MAX_TOP_LOGPROBS};

use super::{CudaBackend, HeadRows};
use crate::error::Result;
use crate::linear::Linear;
use crate::logit_ops::DeviceEdits;
use crate::sample::Sampler;

/// The argmax ids of a call: on the host, or kept on the device for the draft slots.
enum HeadIds {
    Host(Vec<u32>),
    Device(CudaSlice<i32>),
}

/// What [`CudaBackend::head_outputs`] returns.
pub(crate) struct HeadOut {
    pub logits: Vec<f32>,
    pub argmax: Vec<u32>,
    /// The argmax ids on the device, for a batch with `argmax_slots` (then `argmax` is
    /// empty): the caller stores them in the draft slots.
    pub kept_ids: Option<CudaSlice<i32>>,
    pub sampled: Vec<u32>,
    pub logprobs: Vec<RowLogprobs>,
}

impl CudaBackend {
    /// Uploads the rows the head serves.
    pub(super) fn head_rows_upload(&self, batch: &Batch) -> Result<HeadRows> {
        let s = &self.gpu.stream;
        let up = |v: Vec<i32>| s.clone_htod(if v.is_empty() { &[0][..] } else { &v });
        let sample_idx: Vec<u32> = batch.sample_rows.iter().map(|r| r.row).collect();
        Ok(HeadRows {
            logit_rows: up(batch.logit_rows.iter().map(|&r| r as i32).collect())?,
            argmax_rows: up(batch.argmax_rows.iter().map(|&r| r as i32).collect())?,
            sample_rows: up(batch.sample_rows.iter().map(|r| r.row as i32).collect())?,
            sample_params: s.clone_htod(&if batch.sample_rows.is_empty() {
                vec![0.0; 4]
            } else {
                Sampler::params(&batch.sample_rows)
            })?,
            argmax_edits: DeviceEdits::upload(s, &batch.edits, &batch.argmax_rows)?,
            sample_edits: DeviceEdits::upload(s, &batch.edits, &sample_idx)?,
            min_p: match batch.sample_rows.iter().any(|r| r.min_p > 0.0) {
                true => Some(s.clone_htod(
                    &batch.sample_rows.iter().flat_map(|r| [r.temperature as f64, r.min_p as f64]).collect::<Vec<_>>(),
                )?),
                false => None,
            },
        })
    }

    /// This rank's slice of the head's logits for `rows` of `normed` (`[n][h]` f32), on the
    /// device: `[rows][head.out]` f32 (`idx_d` is `rows` uploaded with the step).
    fn head_rows(
        &self,
        head: &Linear,
        normed: &CudaSlice<f32>,
        idx_d: &CudaSlice<i32>,
        rows: &[u32],
    ) -> Result<CudaSlice<f32>> {
        let s = &self.gpu.stream;
        let h = self.cfg.hidden_size;
        let mut sel = s.alloc_zeros::<half::bf16>(rows.len() * h)?;
        self.ops.gather(s, &mut sel, normed, idx_d, rows, h)?;
        let mut logits = s.alloc_zeros::<f32>(rows.len() * head.out)?;
        self.gemm.forward(s, head, &sel, rows.len(), &mut logits)?;
        Ok(logits)
    }

    /// The head's full logits rows for `rows` of `normed` (`[n][h]` f32), on the device:
    /// `[rows][vocab]` f32 in vocabulary order (with TP every rank's slice, all-gathered
    /// and interleaved on the device).
    fn head_full_rows(
        &self,
        head: &Linear,
        normed: &CudaSlice<f32>,
        idx_d: &CudaSlice<i32>,
        rows: &[u32],
    ) -> Result<CudaSlice<f32>> {
        let logits = self.head_rows(head, normed, idx_d, rows)?;
        let Some(comm) = &self.comm else { return Ok(logits) };
        let s = &self.gpu.stream;
        let world = comm.world;
        let mut all = s.alloc_zeros::<f32>(rows.len() * head.out * world)?;
        comm.all_gather(&logits, &mut all)?;
        // Rank-major `[world][rows][part]` → `[rows][vocab]` on the device.
        let mut ordered = s.alloc_zeros::<f32>(rows.len() * head.out * world)?;
        self.ops.interleave_ranks(s, &mut ordered, &all, world, rows.len(), head.out)?;
        Ok(ordered)
    }

    /// Vocabulary-parallel head over `rows` of `normed`: logits on the host.
    fn head_logits(&self, head: &Linear, normed: &CudaSlice<f32>, st: &HeadRows, rows: &[u32]) -> Result<Vec<f32>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let logits = self.head_full_rows(head, normed, &st.logit_rows, rows)?;
        self.settle("head all-gather")?;
        let out = self.gpu.stream.clone_dtoh(&logits)?;
        self.gpu.sync()?;
        Ok(out)
    }

    /// The sampled token of each of `rows` (`Batch::sample_rows`): the full logits rows
    /// stay on the device, the sampling rule runs there ([`Sampler`]) with the parameters
    /// uploaded with the step, and one id per row comes to the host. With TP every rank
    /// samples the same all-gathered rows with the same uniforms (the leader's ids are the
    /// ones the engine uses).
    fn head_sample(
        &self,
        head: &Linear,
        normed: &CudaSlice<f32>,
        st: &HeadRows,
        rows: &[SampleRow],
    ) -> Result<Vec<u32>> {
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let s = &self.gpu.stream;
        let idx: Vec<u32> = rows.iter().map(|r| r.row).collect();
        let mut logits = self.head_full_rows(head, normed, &st.sample_rows, &idx)?;
        let vocab = logits.len() / rows.len();
        self.logit_ops.edit(s, &mut logits, rows.len(), vocab, 0, &st.sample_edits)?;
        if let Some(p) = &st.min_p {
            self.logit_ops.min_p(s, &mut logits, rows.len(), vocab, p)?;
        }
        let mut ids = s.alloc_zeros::<i32>(rows.len())?;
        self.sampler.sample(s, &logits, vocab, &st.sample_params, &mut ids, rows.len())?;
        self.settle("head sample")?;
        let out = s.clone_dtoh(&ids)?;
        self.gpu.sync()?;
        Ok(out.into_iter().map(|i| i as u32).collect())
    }

    /// Vocabulary-parallel greedy choice over `rows` of `normed`: the head's logits stay
    /// on the device; one id per row comes to the host (with TP: each rank's best value
    /// and id, all-gathered, the best taken in rank order — lowest id on a tie, as
    /// `mlaserve_core::argmax`).
    /// With `keep` (a batch with [`Batch::argmax_slots`]) the ids stay on the device (with
    /// TP: every rank picks from the all-gathered pairs there, by the host's rule).
    fn head_argmax(
        &self,
        head: &Linear,
        normed: &CudaSlice<f32>,
        st: &HeadRows,
        rows: &[u32],
        keep: bool,
    ) -> Result<HeadIds> {
        if rows.is_empty() {
            return Ok(HeadIds::Host(Vec::new()));
        }
        let s = &self.gpu.stream;
        let n = rows.len();
        let mut logits = self.head_rows(head, normed, &st.argmax_rows, rows)?;
        let offset = self.comm.as_ref().map_or(0, |c| c.rank * head.out);
        self.logit_ops.edit(s, &mut logits, n, head.out, offset, &st.argmax_edits)?;
        let Some(comm) = &self.comm else {
            let mut ids = s.alloc_zeros::<i32>(n)?;
            self.argmax.argmax(s, &logits, &mut ids, head.out)?;
            if keep {
                // To the draft slots (`store_drafts`), no wait: the pass's next stage
                // reads them there.
                return Ok(HeadIds::Device(ids));
            }
            let out = s.clone_dtoh(&ids)?;
            self.gpu.sync()?;
            return Ok(HeadIds::Host(out.into_iter().map(|i| i as u32).collect()));
        };
        let mut pair = s.alloc_zeros::<f32>(2 * n)?;
        self.argmax.argmax_pair_f32(s, &logits, &mut pair, head.out, comm.rank * head.out)?;
        let mut all = s.alloc_zeros::<f32>(2 * n * comm.world)?;
        comm.all_gather(&pair, &mut all)?;
        if keep {
            let mut ids = s.alloc_zeros::<i32>(n)?;
            self.argmax.best_of_pairs(s, &all, &mut ids, comm.world)?;
            return Ok(HeadIds::Device(ids));
        }
        self.settle("head argmax all-gather")?;
        let g = s.clone_dtoh(&all)?;
        self.gpu.sync()?;
        Ok(HeadIds::Host(crate::vocab::best_of_ranks(&g, n, comm.world)))
    }

    /// Everything a call returns from `head` over `normed`: the logits of `logit_rows`
    /// on the host, the argmax and the sampled ids of their rows; then waits for the
    /// stream (bounded under TP, `what` names the call), except after kept drafts where
    /// `unwaited` allows it.
    pub(super) fn head_outputs(
        &self,
        head: &Linear,
        normed: &CudaSlice<f32>,
        rows: &HeadRows,
        batch: &Batch,
        what: &str,
        unwaited: bool,
    ) -> Result<HeadOut> {
        let logits = self.head_logits(head, normed, rows, &batch.logit_rows)?;
        self.mark("head (logits to host)")?;
        let keep = !batch.argmax_slots.is_empty();
        let (argmax, kept_ids) = match self.head_argmax(head, normed, rows, &batch.argmax_rows, keep)? {
            HeadIds::Host(ids) => (ids, None),
            HeadIds::Device(ids) => (Vec::new(), Some(ids)),
        };
        self.mark("head (argmax)")?;
        let sampled = self.head_sample(head, normed, rows, &batch.sample_rows)?;
        self.mark("head (sample)")?;
        let logprobs = self.head_logprobs(head, normed, batch, &argmax, &sampled)?;
        self.mark("head (logprobs)")?;
        // Kept drafts: nothing came to the host, so the stream goes on unwaited — in a
        // group only where every collective of the call took the one-shot kernels
        // (`unwaited`), which end their own waits after the timeout: the next call's
        // uploads from pageable memory wait for the stream, and must not wait forever on
        // a stalled peer (the pass's read of the drafts waits with the deadline).
        if !(keep && unwaited) {
            self.settle(what)?;
        }
        if !keep {
            self.gpu.sync()?;
        }
        Ok(HeadOut { logits, argmax, kept_ids, sampled, logprobs })
    }

    /// The log-probabilities of `batch.logprob_rows` (`mlaserve_core::row_logprobs` of
    /// the raw rows at the ids the rows chose): the full rows computed again, unedited,
    /// the kernel over them on the device, and only the chosen id's and the top ones'
    /// values to the host. The chosen ids are uploaded here, after the choices: the
    /// step's collectives have settled, the stream is idle, so the upload cannot wait on
    /// a stalled peer.
    fn head_logprobs(
        &self,
        head: &Linear,
        normed: &CudaSlice<f32>,
        batch: &Batch,
        argmax: &[u32],
        sampled: &[u32],
    ) -> Result<Vec<RowLogprobs>> {
        let rows = &batch.logprob_rows;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let s = &self.gpu.stream;
        let n = rows.len();
        let idx: Vec<u32> = rows.iter().map(|l| l.row).collect();
        let chosen: Vec<i32> = idx.iter().map(|&r| batch.chosen(r, argmax, sampled).map_or(-1, |t| t as i32)).collect();
        let idx_d = s.clone_htod(&idx.iter().map(|&r| r as i32).collect::<Vec<_>>())?;
        let chosen_d = s.clone_htod(&chosen)?;
        let top_d = s.clone_htod(&rows.iter().map(|l| l.top as i32).collect::<Vec<_>>())?;
        let logits = self.head_full_rows(head, normed, &idx_d, &idx)?;
        let vocab = logits.len() / n;
        let t = MAX_TOP_LOGPROBS as usize;
        let mut lp = s.alloc_zeros::<f32>(n)?;
        let mut top_id = s.alloc_zeros::<i32>(n * t)?;
        let mut top_lp = s.alloc_zeros::<f32>(n * t)?;
        self.logit_ops.logprobs(s, &logits, n, vocab, &chosen_d, &top_d, &mut lp, &mut top_id, &mut top_lp)?;
        self.settle("head logprobs")?;
        let (lp, top_id, top_lp) = (s.clone_dtoh(&lp)?, s.clone_dtoh(&top_id)?, s.clone_dtoh(&top_lp)?);
        self.gpu.sync()?;
        Ok((0..n)
            .map(|r| RowLogprobs {
                logprob: lp[r],
                top: (0..t)
                    .take_while(|&j| top_id[r * t + j] >= 0)
                    .map(|j| (top_id[r * t + j] as u32, top_lp[r * t + j]))
                    .collect(),
            })
            .collect())
    }
}
