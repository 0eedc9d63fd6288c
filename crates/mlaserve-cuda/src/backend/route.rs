//! Which rows of a step take which form of MLA (mixed steps: attention split by kind):
//! decode windows keep the absorbed form over the latent cache (decompressing a long
//! context for one to four query rows would cost far more than it saves), sequences that
//! bring more new tokens take the expanded form ([`crate::prefill`]). The split is made
//! per sequence, from its own chunk length only, and laid out with the step's metadata:
//! everything is uploaded once, before the step's first collective (see `Step::logit_rows`).
//!
//! Each row's `o` (o_proj's input) is written by exactly one path: the expanded kernel
//! writes its sequences' rows in place; in a mixed step the absorbed rows are gathered,
//! run compact (with their own block tables and lengths, so uniform decode windows still
//! get the decode kernel) and scattered back.

use cudarc::driver::CudaSlice;
use mlaserve_core::Batch;

use super::CudaBackend;
use crate::error::{CudaError, Result};
use crate::layout::AttnMeta;
use crate::prefill::{PrefillDims, PrefillPlan, PrefillSeq};

/// Most new tokens of a sequence that still take the absorbed form under
/// [`PrefillPath::Auto`]: a decode window (the last token and up to 3 drafts).
pub const ABSORBED_MAX_ROWS: usize = 4;

/// Which form of MLA the sequences of a step take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillPath {
    /// Absorbed for sequences with at most [`ABSORBED_MAX_ROWS`] new tokens, expanded for
    /// the others (when the model's head dimensions have an expanded kernel).
    #[default]
    Auto,
    /// Every row absorbed (the path of every row before the expanded form existed).
    Absorbed,
    /// Every row expanded, decode windows included (tests and benchmarks); an error for
    /// head dimensions without an expanded kernel.
    Expanded,
    /// Expanded for the chunks the engine marks as prefill ([`mlaserve_core::SeqChunk::
    /// prefill`]), whatever their length, absorbed for decode windows (all absorbed when
    /// the heads have no expanded kernel). The form of a token then depends on what it is,
    /// never on how its prompt was chunked ([`super::CudaOptions::batch_invariant`]).
    Flagged,
}

/// A step's attention routing.
#[derive(Debug)]
pub(crate) struct Route {
    pub abs: Absorbed,
    /// The expanded sequences (their query rows are the step's own rows).
    pub exp: Option<PrefillPlan>,
}

/// The rows that take the absorbed form.
#[derive(Debug)]
pub(crate) enum Absorbed {
    /// Every row of the step: the step's own metadata serves.
    All,
    /// None.
    Nothing,
    /// Some: their own compact metadata.
    Rows(Box<AbsRows>),
}

/// The absorbed rows of a mixed step, compact: row `i` here is step row `rows[i]`.
#[derive(Debug)]
pub(crate) struct AbsRows {
    pub rows: Vec<u32>,
    pub rows_d: CudaSlice<i32>,
    pub pos: CudaSlice<i32>,
    /// Each row's sequence, numbered among the absorbed sequences.
    pub row_seq: CudaSlice<i32>,
    /// `[absorbed sequences][bt_stride]`.
    pub tables: CudaSlice<i32>,
    pub seq_lens: CudaSlice<i32>,
    pub meta: AttnMeta,
    /// `Some(q_len)` when every absorbed sequence has that many new tokens.
    pub uniform: Option<usize>,
    /// Each absorbed sequence's (new tokens, seq_len).
    pub chunks: Vec<(usize, usize)>,
}

impl CudaBackend {
    /// This rank's head dimensions, when the expanded kernels take them (and the latent
    /// widths suit the gather: multiples of 8).
    pub(super) fn prefill_dims(&self) -> Option<PrefillDims> {
        let c = &self.cfg;
        let heads = self.blocks.first().or(self.mtp.first().map(|m| &m.block)).map(|b| b.attn.heads)?;
        let d = PrefillDims { heads, nope: c.qk_nope_head_dim, rope: c.qk_rope_head_dim, vdim: c.v_head_dim };
        (d.instance().is_some() && c.kv_lora_rank.is_multiple_of(8)).then_some(d)
    }

    /// Splits `batch`'s sequences between the two forms and uploads what each needs
    /// (`bt_stride`, `max_block` as in the step's metadata).
    pub(super) fn route(&self, batch: &Batch, bt_stride: usize, max_block: usize) -> Result<Route> {
        let s = &self.gpu.stream;
        let ok = self.prefill_dims().is_some();
        let expand: Vec<bool> = batch
            .seqs
            .iter()
            .map(|c| match self.opts.prefill {
                PrefillPath::Absorbed => false,
                PrefillPath::Expanded => true,
                PrefillPath::Auto => ok && c.tokens.len() > ABSORBED_MAX_ROWS,
                PrefillPath::Flagged => ok && c.prefill,
            })
            .collect();
        if self.opts.prefill == PrefillPath::Expanded && !ok {
            return Err(CudaError::shape("mla_prefill", "PrefillPath::Expanded: no expanded kernel takes these heads"));
        }
        let n_exp = expand.iter().filter(|&&e| e).count();
        if n_exp == 0 {
            return Ok(Route { abs: Absorbed::All, exp: None });
        }
        let (mut exp, mut rows, mut pos, mut row_seq, mut tables, mut seq_lens) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        let mut max_pos = 0;
        let mut row = 0;
        for (i, c) in batch.seqs.iter().enumerate() {
            let len = c.tokens.len();
            if expand[i] {
                exp.push(PrefillSeq { q_row0: row, q_len: len, k_len: c.start_pos + len, table_row: i });
            } else {
                let k = seq_lens.len() as i32;
                for j in 0..len {
                    rows.push((row + j) as u32);
                    pos.push((c.start_pos + j) as i32);
                    row_seq.push(k);
                    max_pos = max_pos.max(c.start_pos + j);
                }
                let mut t = vec![0i32; bt_stride];
                for (dst, &b) in t.iter_mut().zip(&c.block_table) {
                    *dst = b as i32;
                }
                tables.extend(t);
                seq_lens.push((c.start_pos + len) as i32);
            }
            row += len;
        }
        let exp = Some(PrefillPlan::new(s, &exp)?);
        if n_exp == batch.seqs.len() {
            return Ok(Route { abs: Absorbed::Nothing, exp });
        }
        let chunks: Vec<(usize, usize)> = batch
            .seqs
            .iter()
            .zip(&expand)
            .filter(|(_, &e)| !e)
            .map(|(c, _)| (c.tokens.len(), c.start_pos + c.tokens.len()))
            .collect();
        let lens: Vec<usize> = chunks.iter().map(|c| c.0).collect();
        let uniform = lens.iter().all(|&l| l == lens[0]).then_some(lens[0]);
        let meta = AttnMeta { n: rows.len(), seqs: lens.len(), bt_stride, max_pos, max_block };
        let rows_d = s.clone_htod(&rows.iter().map(|&r| r as i32).collect::<Vec<_>>())?;
        Ok(Route {
            abs: Absorbed::Rows(Box::new(AbsRows {
                rows,
                rows_d,
                pos: s.clone_htod(&pos)?,
                row_seq: s.clone_htod(&row_seq)?,
                tables: s.clone_htod(&tables)?,
                seq_lens: s.clone_htod(&seq_lens)?,
                meta,
                uniform,
                chunks,
            })),
            exp,
        })
    }
}
