//! Leader/follower execution of a tensor-parallel group.
//!
//! The leader (rank 0) runs the engine on a [`TpLeader`], which is itself a [`Backend`]:
//! before each call it sends the step plan (the op and its [`Batch`]) over the group's
//! [`PlanChannel`] (shared memory, or a collective), then runs its own shard. Followers sit in [`run_follower`],
//! receive each plan and run the same call on their shard, so every rank executes the
//! same sequence of forwards and meets the same collectives inside them. Verification is
//! decided once, on the leader; the accepted tokens reach the followers inside the next
//! plan (the MTP batch carries them), so every rank drafts from identical inputs. (A
//! follower's backend answers the plan's `argmax_rows` and `sample_rows` too, on the same
//! all-gathered logits with the same parameters and uniforms; only the leader's ids are
//! used.)
//!
//! A step crosses as one plan: its target forward, with the drafting pass that will
//! follow it planned before it ([`PassPlan`], [`Backend::forward_planned`]). After the
//! forward each follower resolves the plan with its own choices
//! ([`PassPlan::resolve`]: the accepted drafts, the next tokens) and runs the stages
//! ([`mlaserve_core::drafting::run_stages`], the code the leader runs on its shard),
//! building every later stage's batch from the drafts its own shard computes: every
//! rank takes the same argmax (and samples the same ids) of the same all-gathered
//! logits, so the batches agree. Requests the step finishes draft too, since only the
//! leader knows which they are.
//!
//! Hidden states stay on each rank: the leader numbers the ones it returns and names
//! the number in a plan; followers keep their own under the same numbers. The stage
//! outputs a pass keeps for the next stay on each rank too, unnumbered.
//!
//! Block tables cross as changes: each sequence's table names how many leading blocks
//! it keeps from the table at the same index of the previous batch plan, and sends only
//! the rest. Within a step (the verification's forward and the drafting stages) and from
//! step to step a table changes by a block now and then, so a long context's tables
//! cross once, not at every call. Both sides keep the last batch plan's tables.
//!
//! A follower waits for each plan no longer than the plan channel's timeout
//! (so it notices a leader that died), and an idle engine calls
//! [`Backend::keep_alive`] every [`Backend::idle_interval`]: the leader then sends a plan
//! with nothing to run, so a group left without requests outlives that timeout.

use crate::plans::PlanChannel;
use mlaserve_core::backend::{Backend, Batch, ForwardOutput, SeqChunk};
use mlaserve_core::drafting::{
    run_stages, ChunkKind, DraftPass, PassPlan, PlannedChunk, StageMemory, StageScratch, MAX_DRAFTS,
};
use mlaserve_core::ModelConfig;
use mlaserve_core::{Error, Result};
use mlaserve_core::{LogitEdit, LogprobRow, RowEdits, SampleRow};
use std::collections::VecDeque;

const OP_FORWARD: u32 = 1;
const OP_MTP: u32 = 2;
const OP_SHUTDOWN: u32 = 3;
const OP_CONCAT: u32 = 4;
/// Nothing to run: the leader is idle and the group alive ([`Backend::keep_alive`]).
const OP_KEEP_ALIVE: u32 = 5;
/// The id of a stage output a pass keeps for the next: no plan names one.
const NO_ID: u32 = u32::MAX;
/// Hidden states a follower keeps (the engine only refers back to recent ones).
const KEEP_HIDDEN: usize = 64;

/// A hidden state tagged with the plan number that produced it.
#[derive(Debug)]
pub struct TpHidden<H> {
    pub id: u32,
    pub inner: H,
}

/// The leader's view of a TP group: a backend that mirrors every call to the followers.
pub struct TpLeader<B: Backend, C> {
    inner: B,
    comm: C,
    next_id: u32,
    /// The block tables of the last batch plan (what the followers hold too).
    tables: Vec<Vec<u32>>,
    /// When the last plan was sent (a keep-alive is needless sooner than the interval).
    last_sent: std::time::Instant,
    /// Plans sent so far.
    plans: u64,
    /// Rank 0's own stage outputs kept from one drafting pass for the next.
    stages: StageMemory<B::Hidden>,
    /// The last forward's plan announced the pass the engine runs next.
    announced: bool,
}

impl<B: Backend, C: PlanChannel> std::fmt::Debug for TpLeader<B, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpLeader").field("world_size", &self.comm.world_size()).finish()
    }
}

impl<B: Backend, C: PlanChannel> TpLeader<B, C> {
    /// `inner` is rank 0's shard; `comm` the plan channel (rank 0 of the group).
    pub fn new(inner: B, comm: C) -> Result<Self> {
        if comm.rank() != 0 {
            return Err(Error::Collective(format!("TpLeader on rank {}; the leader is rank 0", comm.rank())));
        }
        Ok(TpLeader {
            inner,
            comm,
            next_id: 0,
            tables: Vec::new(),
            last_sent: std::time::Instant::now(),
            plans: 0,
            stages: StageMemory::default(),
            announced: false,
        })
    }

    fn send(&mut self, words: &[u32]) -> Result<()> {
        self.comm.send_plan(words)?;
        self.last_sent = std::time::Instant::now();
        self.plans += 1;
        Ok(())
    }

    /// Plans sent to the followers so far (keep-alives included).
    pub fn plans_sent(&self) -> u64 {
        self.plans
    }

    /// Tells the followers to leave their loop.
    pub fn shutdown(&mut self) -> Result<()> {
        self.send(&[OP_SHUTDOWN])
    }
}

impl<B: Backend, C: PlanChannel> Backend for TpLeader<B, C> {
    type Hidden = TpHidden<B::Hidden>;

    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }

    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    fn memory_plan(&self) -> Option<mlaserve_core::memory::MemoryPlan> {
        self.inner.memory_plan()
    }

    fn forward(&mut self, batch: &Batch) -> Result<ForwardOutput<Self::Hidden>> {
        self.forward_planned(batch, None)
    }

    /// The forward's plan carries the pass's plan, which the followers run after it.
    fn forward_planned(&mut self, batch: &Batch, plan: Option<&PassPlan>) -> Result<ForwardOutput<Self::Hidden>> {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        let mut w = vec![OP_FORWARD, id, u32::from(plan.is_some())];
        if let Some(p) = plan {
            encode_plan(p, &mut w);
        }
        encode_batch(batch, &mut self.tables, &mut w);
        self.announced = plan.is_some();
        self.send(&w)?;
        let out = self.inner.forward(batch)?;
        Ok(ForwardOutput {
            hidden: TpHidden { id, inner: out.hidden },
            logits: out.logits,
            argmax: out.argmax,
            sampled: out.sampled,
            logprobs: out.logprobs,
        })
    }

    fn mtp_forward(
        &mut self,
        layer: usize,
        batch: &Batch,
        prev: &Self::Hidden,
        hidden_rows: &[u32],
    ) -> Result<ForwardOutput<Self::Hidden>> {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        let mut w = vec![OP_MTP, id, layer as u32, prev.id, hidden_rows.len() as u32];
        w.extend_from_slice(hidden_rows);
        encode_batch(batch, &mut self.tables, &mut w);
        self.send(&w)?;
        let out = self.inner.mtp_forward(layer, batch, &prev.inner, hidden_rows)?;
        Ok(ForwardOutput {
            hidden: TpHidden { id, inner: out.hidden },
            logits: out.logits,
            argmax: out.argmax,
            sampled: out.sampled,
            logprobs: out.logprobs,
        })
    }

    fn hidden_to_host(&self, h: &Self::Hidden) -> Result<Vec<f32>> {
        self.inner.hidden_to_host(&h.inner)
    }

    fn graph_captures(&self) -> u64 {
        self.inner.graph_captures()
    }

    fn graph_batch_sizes(&self) -> Vec<usize> {
        self.inner.graph_batch_sizes()
    }

    /// A quarter of the plan channel's collective timeout: a follower waits for the next
    /// plan no longer than that timeout, so an idle leader must send one sooner.
    fn idle_interval(&self) -> Option<std::time::Duration> {
        self.comm.timeout().map(|t| t / 4)
    }

    /// A plan with nothing to run, unless one was sent within the idle interval.
    fn keep_alive(&mut self) -> Result<()> {
        match self.idle_interval() {
            Some(d) if self.last_sent.elapsed() < d => Ok(()),
            _ => self.send(&[OP_KEEP_ALIVE]),
        }
    }

    /// As rank 0's shard: every rank computes the same ids and keeps them in its own
    /// slots (the plans carry the links and slots), and only the leader's are read.
    fn keeps_drafts(&self) -> bool {
        self.inner.keeps_drafts()
    }

    fn read_drafts(&mut self, n: usize) -> Result<Vec<u32>> {
        self.inner.read_drafts(n)
    }

    fn concat_hidden(&mut self, parts: &[(&Self::Hidden, &[u32])]) -> Result<Self::Hidden> {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        let mut w = vec![OP_CONCAT, id, parts.len() as u32];
        for (h, rows) in parts {
            w.push(h.id);
            w.push(rows.len() as u32);
            w.extend_from_slice(rows);
        }
        self.send(&w)?;
        let inner: Vec<(&B::Hidden, &[u32])> = parts.iter().map(|(h, r)| (&h.inner, *r)).collect();
        Ok(TpHidden { id, inner: self.inner.concat_hidden(&inner)? })
    }

    /// The pass the last forward's plan announced (the followers run it already), on
    /// rank 0's shard.
    fn draft_stages(
        &mut self,
        pass: &mut DraftPass,
        batch: &mut Batch,
        target: &Self::Hidden,
        mem: &mut StageMemory<Self::Hidden>,
        sc: &mut StageScratch,
    ) -> Result<u64> {
        if !std::mem::take(&mut self.announced) {
            return Err(Error::Collective("a drafting pass its forward did not plan (forward_planned)".into()));
        }
        // The engine's kept outputs are rank 0's own, under no plan's number.
        self.stages.prev.clear();
        self.stages.prev.extend(mem.prev.drain(..).map(|h| h.inner));
        let r = run_stages(&mut self.inner, pass, batch, &target.inner, &mut self.stages, sc);
        mem.prev.extend(self.stages.prev.drain(..).map(|inner| TpHidden { id: NO_ID, inner }));
        r
    }
}

/// A follower rank's loop: executes the leader's plans on `backend` until the leader
/// shuts the group down (returns `Ok`) or a collective or backend call fails.
pub fn run_follower<B: Backend, C: PlanChannel>(backend: &mut B, comm: &C) -> Result<()> {
    let mut hidden: VecDeque<(u32, B::Hidden)> = VecDeque::new();
    let mut tables: Vec<Vec<u32>> = Vec::new();
    let (mut stages, mut scratch, mut pass) = (StageMemory::default(), StageScratch::default(), DraftPass::default());
    loop {
        let w = comm.receive_plan()?;
        let mut r = Reader { w: &w, i: 0 };
        match r.next()? {
            OP_SHUTDOWN => return Ok(()),
            OP_KEEP_ALIVE => {}
            OP_FORWARD => {
                let id = r.next()?;
                let plan = if r.next()? != 0 { Some(decode_plan(&mut r)?) } else { None };
                let mut batch = decode_batch(&mut r, &mut tables)?;
                let out = backend.forward(&batch)?;
                if let Some(plan) = plan {
                    plan.resolve(&mut batch, &out.argmax, &out.sampled, &mut pass)?;
                    run_stages(backend, &mut pass, &mut batch, &out.hidden, &mut stages, &mut scratch)?;
                }
                hidden.push_back((id, out.hidden));
            }
            OP_MTP => {
                let id = r.next()?;
                let layer = r.next()? as usize;
                let prev_id = r.next()?;
                let n = r.next()? as usize;
                let rows = r.take(n)?.to_vec();
                let batch = decode_batch(&mut r, &mut tables)?;
                let prev = find(&hidden, prev_id)?;
                let out = backend.mtp_forward(layer, &batch, prev, &rows)?;
                hidden.push_back((id, out.hidden));
            }
            OP_CONCAT => {
                let id = r.next()?;
                let n = r.next()? as usize;
                let mut spec = Vec::with_capacity(n);
                for _ in 0..n {
                    let hid = r.next()?;
                    let len = r.next()? as usize;
                    spec.push((hid, r.take(len)?.to_vec()));
                }
                let mut parts = Vec::with_capacity(n);
                for (hid, rows) in &spec {
                    parts.push((find(&hidden, *hid)?, rows.as_slice()));
                }
                let out = backend.concat_hidden(&parts)?;
                hidden.push_back((id, out));
            }
            op => return Err(Error::Collective(format!("unknown plan op {op}"))),
        }
        while hidden.len() > KEEP_HIDDEN {
            hidden.pop_front();
        }
    }
}

/// The hidden state a plan names.
fn find<H>(hidden: &VecDeque<(u32, H)>, id: u32) -> Result<&H> {
    hidden
        .iter()
        .find(|(i, _)| *i == id)
        .map(|(_, h)| h)
        .ok_or_else(|| Error::Collective(format!("plan refers to hidden state {id}, no longer kept")))
}

/// Words of one [`PlannedChunk`] in a plan, besides its kept rows (one per full stage
/// after the first).
const CHUNK_WORDS: usize = 5;

/// Writes `p` into `w`.
fn encode_plan(p: &PassPlan, w: &mut Vec<u32>) {
    let n_kept = p.full_stages().saturating_sub(1);
    w.extend_from_slice(&[p.k as u32, p.n_mtp as u32, u32::from(p.keep), p.chunks.len() as u32]);
    for c in &p.chunks {
        let kind = match c.kind {
            ChunkKind::Window => 0,
            ChunkKind::Last => 1,
            ChunkKind::Mid => 2,
        };
        w.extend_from_slice(&[kind, u32::from(c.cont), u32::from(c.in_place), c.n_tok as u32, c.last_tok]);
        w.extend_from_slice(&c.kept[..n_kept]);
    }
    w.push(p.beyond.len() as u32);
    w.extend_from_slice(&p.beyond);
}

/// Reads a plan written by [`encode_plan`].
fn decode_plan(r: &mut Reader) -> Result<PassPlan> {
    let (k, n_mtp, keep, n) = (r.next()? as usize, r.next()? as usize, r.next()? != 0, r.next()? as usize);
    if k == 0 || k > MAX_DRAFTS || n_mtp == 0 {
        return Err(Error::Collective(format!("a drafting plan of k = {k} with {n_mtp} MTP layers")));
    }
    let mut p = PassPlan { k, n_mtp, keep, ..Default::default() };
    let n_kept = p.full_stages() - 1;
    for _ in 0..n {
        let w = r.take(CHUNK_WORDS + n_kept)?;
        let kind = match w[0] {
            0 => ChunkKind::Window,
            1 => ChunkKind::Last,
            2 => ChunkKind::Mid,
            x => return Err(Error::Collective(format!("a planned chunk of kind {x}"))),
        };
        let mut kept = [0; MAX_DRAFTS];
        kept[..n_kept].copy_from_slice(&w[CHUNK_WORDS..]);
        p.chunks.push(PlannedChunk {
            kind,
            cont: w[1] != 0,
            in_place: w[2] != 0,
            n_tok: w[3] as usize,
            last_tok: w[4],
            kept,
        });
    }
    let nb = r.next()? as usize;
    p.beyond = r.take(nb)?.to_vec();
    Ok(p)
}

/// Writes `b` into `w`; `tables` holds the previous batch plan's block tables and is left
/// holding `b`'s. A table crosses as the count of leading blocks it shares with the one
/// at its index in `tables`, then the count and ids of the rest.
fn encode_batch(b: &Batch, tables: &mut Vec<Vec<u32>>, w: &mut Vec<u32>) {
    w.push(b.seqs.len() as u32);
    for (i, s) in b.seqs.iter().enumerate() {
        w.push(s.start_pos as u32);
        w.push(u32::from(s.prefill));
        w.push(s.tokens.len() as u32);
        w.extend_from_slice(&s.tokens);
        let kept = tables.get(i).map_or(0, |t| t.iter().zip(&s.block_table).take_while(|(a, b)| a == b).count());
        w.push(kept as u32);
        w.push((s.block_table.len() - kept) as u32);
        w.extend_from_slice(&s.block_table[kept..]);
    }
    tables.truncate(b.seqs.len());
    for (i, s) in b.seqs.iter().enumerate() {
        match tables.get_mut(i) {
            Some(t) => {
                t.clear();
                t.extend_from_slice(&s.block_table);
            }
            None => tables.push(s.block_table.clone()),
        }
    }
    w.push(b.logit_rows.len() as u32);
    w.extend_from_slice(&b.logit_rows);
    w.push(b.argmax_rows.len() as u32);
    w.extend_from_slice(&b.argmax_rows);
    // Sample rows, seven words each: row, temperature bits, top_k, top_p bits, min_p bits,
    // u's bits (low word, high word); every rank gets the same parameters bit for bit.
    w.push(b.sample_rows.len() as u32);
    for s in &b.sample_rows {
        let u = s.u.to_bits();
        w.extend_from_slice(&[
            s.row,
            s.temperature.to_bits(),
            s.top_k,
            s.top_p.to_bits(),
            s.min_p.to_bits(),
            u as u32,
            (u >> 32) as u32,
        ]);
    }
    // Edits: per row, the row, the count, then four words per edit (token, bias,
    // repetition and sub bits). Log-probability rows: row and top.
    w.push(b.edits.len() as u32);
    for e in &b.edits {
        w.extend_from_slice(&[e.row, e.edits.len() as u32]);
        for t in &e.edits {
            w.extend_from_slice(&[t.token, t.bias.to_bits(), t.repetition.to_bits(), t.sub.to_bits()]);
        }
    }
    w.push(b.logprob_rows.len() as u32);
    for l in &b.logprob_rows {
        w.extend_from_slice(&[l.row, l.top]);
    }
    // Kept drafts: links (row, slot), then the argmax rows' slots.
    w.push(b.draft_links.len() as u32);
    for &(row, slot) in &b.draft_links {
        w.extend_from_slice(&[row, slot]);
    }
    w.push(b.argmax_slots.len() as u32);
    w.extend_from_slice(&b.argmax_slots);
}

struct Reader<'a> {
    w: &'a [u32],
    i: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u32]> {
        let s = self.w.get(self.i..self.i + n).ok_or_else(|| Error::Collective("truncated step plan".into()))?;
        self.i += n;
        Ok(s)
    }
    fn next(&mut self) -> Result<u32> {
        Ok(self.take(1)?[0])
    }
}

/// Reads a batch written by [`encode_batch`] with the same `tables` (updated alike).
fn decode_batch(r: &mut Reader, tables: &mut Vec<Vec<u32>>) -> Result<Batch> {
    let n = r.next()? as usize;
    let mut seqs = Vec::with_capacity(n);
    for i in 0..n {
        let start_pos = r.next()? as usize;
        let prefill = r.next()? != 0;
        let nt = r.next()? as usize;
        let tokens = r.take(nt)?.to_vec();
        let kept = r.next()? as usize;
        let nb = r.next()? as usize;
        let prev = tables.get(i).map_or(&[][..], |t| t.as_slice());
        let head = prev.get(..kept).ok_or_else(|| {
            Error::Collective(format!(
                "plan keeps {kept} blocks of sequence {i}'s table; the last plan's had {}",
                prev.len()
            ))
        })?;
        let mut block_table = Vec::with_capacity(kept + nb);
        block_table.extend_from_slice(head);
        block_table.extend_from_slice(r.take(nb)?);
        seqs.push(SeqChunk { tokens, start_pos, block_table, prefill });
    }
    tables.clear();
    tables.extend(seqs.iter().map(|s| s.block_table.clone()));
    let nl = r.next()? as usize;
    let logit_rows = r.take(nl)?.to_vec();
    let na = r.next()? as usize;
    let argmax_rows = r.take(na)?.to_vec();
    let ns = r.next()? as usize;
    let sample_rows = r
        .take(ns * 7)?
        .chunks_exact(7)
        .map(|w| SampleRow {
            row: w[0],
            temperature: f32::from_bits(w[1]),
            top_k: w[2],
            top_p: f32::from_bits(w[3]),
            min_p: f32::from_bits(w[4]),
            u: f64::from_bits(w[5] as u64 | (w[6] as u64) << 32),
        })
        .collect();
    let ne = r.next()? as usize;
    let mut edits = Vec::with_capacity(ne);
    for _ in 0..ne {
        let row = r.next()?;
        let n = r.next()? as usize;
        let e = r
            .take(4 * n)?
            .chunks_exact(4)
            .map(|w| LogitEdit {
                token: w[0],
                bias: f32::from_bits(w[1]),
                repetition: f32::from_bits(w[2]),
                sub: f32::from_bits(w[3]),
            })
            .collect();
        edits.push(RowEdits { row, edits: e });
    }
    let nl = r.next()? as usize;
    let logprob_rows = r.take(2 * nl)?.chunks_exact(2).map(|w| LogprobRow { row: w[0], top: w[1] }).collect();
    let nk = r.next()? as usize;
    let draft_links = r.take(2 * nk)?.chunks_exact(2).map(|w| (w[0], w[1])).collect();
    let ns = r.next()? as usize;
    let argmax_slots = r.take(ns)?.to_vec();
    Ok(Batch { seqs, logit_rows, argmax_rows, sample_rows, edits, logprob_rows, draft_links, argmax_slots })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plan_round_trip() {
        let b = Batch {
            seqs: vec![
                SeqChunk { tokens: vec![1, 2, 3], start_pos: 64, block_table: vec![4, 9], prefill: true },
                SeqChunk { tokens: vec![7], start_pos: 0, block_table: vec![0], prefill: false },
            ],
            logit_rows: vec![2, 3],
            argmax_rows: vec![0, 3],
            sample_rows: vec![
                SampleRow { row: 1, temperature: 0.7, top_k: 50, top_p: 0.9, min_p: 0.05, u: 0.123_456_789_012_345_67 },
                SampleRow { row: 3, temperature: 1e-30, top_k: 0, top_p: 1.0, min_p: 0.0, u: 1.0 - f64::EPSILON / 2.0 },
            ],
            edits: vec![RowEdits {
                row: 3,
                edits: vec![LogitEdit { token: 5, bias: -1.5, repetition: 1.2, sub: 0.25 }],
            }],
            logprob_rows: vec![LogprobRow { row: 0, top: 5 }, LogprobRow { row: 3, top: 0 }],
            draft_links: vec![(1, 6), (2, 0)],
            argmax_slots: vec![3, 7],
        };
        let mut w = Vec::new();
        encode_batch(&b, &mut Vec::new(), &mut w);
        let got = decode_batch(&mut Reader { w: &w, i: 0 }, &mut Vec::new()).unwrap();
        assert_eq!(got, b);
        assert!(decode_batch(&mut Reader { w: &w[..w.len() - 1], i: 0 }, &mut Vec::new()).is_err());
    }

    /// A planned pass crosses whole; a cut plan is refused.
    #[test]
    fn pass_plan_round_trip() {
        let chunk = |kind, kept: [u32; MAX_DRAFTS]| PlannedChunk {
            kind,
            cont: kind == ChunkKind::Window,
            in_place: kind != ChunkKind::Mid,
            kept,
            n_tok: 103,
            last_tok: 77,
        };
        for (k, n_mtp) in [(3, 3), (4, 2), (2, 1), (1, 3)] {
            let n_kept = n_mtp.min(k) - 1;
            let mut kept = [0; MAX_DRAFTS];
            kept[..n_kept].copy_from_slice(&[5, 9, 11][..n_kept]);
            let p = PassPlan {
                k,
                n_mtp,
                keep: k % 2 == 0,
                chunks: vec![
                    chunk(ChunkKind::Window, kept),
                    chunk(ChunkKind::Mid, [0; MAX_DRAFTS]),
                    chunk(ChunkKind::Last, kept),
                ],
                beyond: vec![3, 4, 5],
            };
            let mut w = Vec::new();
            encode_plan(&p, &mut w);
            assert_eq!(decode_plan(&mut Reader { w: &w, i: 0 }).unwrap(), p, "k = {k}, {n_mtp} MTP layers");
            assert!(decode_plan(&mut Reader { w: &w[..w.len() - 1], i: 0 }).is_err());
        }
    }

    /// Block tables cross as changes against the previous batch plan's: grown, cut,
    /// replaced, reordered, fewer and more sequences all decode to the leader's tables,
    /// and a long table crosses once.
    #[test]
    fn block_tables_cross_as_changes() {
        let seq = |blocks: Vec<u32>| SeqChunk { tokens: vec![5], start_pos: 3, block_table: blocks, prefill: false };
        let long: Vec<u32> = (1000..3000).collect();
        let grown: Vec<u32> = (1000..3001).collect();
        let batches = [
            vec![seq(long.clone()), seq(vec![1, 2, 3])],
            vec![seq(long.clone()), seq(vec![1, 2, 3])],
            vec![seq(grown.clone()), seq(vec![1, 2, 3, 4])],
            vec![seq(vec![1, 2, 3, 4]), seq(grown.clone())],
            vec![seq(vec![1, 2]), seq(grown.clone()), seq(vec![])],
            vec![seq(vec![9, 8])],
            vec![],
            vec![seq(long.clone()), seq(vec![7])],
        ];
        let (mut sent, mut held) = (Vec::new(), Vec::new());
        let mut sizes = Vec::new();
        for seqs in batches {
            let b = Batch { seqs, ..Default::default() };
            let mut w = Vec::new();
            encode_batch(&b, &mut sent, &mut w);
            sizes.push(w.len());
            assert_eq!(decode_batch(&mut Reader { w: &w, i: 0 }, &mut held).unwrap(), b);
            assert_eq!(sent, held);
        }
        assert!(sizes[0] > 2000 && sizes[1] < 30 && sizes[2] < 30, "{sizes:?}");
        // A plan that keeps more blocks than the follower holds is refused.
        let b = Batch { seqs: vec![seq(vec![1, 2, 3])], ..Default::default() };
        let mut w = Vec::new();
        encode_batch(&b, &mut vec![vec![1, 2, 3]], &mut w);
        let e = decode_batch(&mut Reader { w: &w, i: 0 }, &mut vec![vec![1]]).unwrap_err().to_string();
        assert!(e.contains("keeps 3 blocks"), "{e}");
    }
}
