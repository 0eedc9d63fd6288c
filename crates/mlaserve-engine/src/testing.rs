//! [`SyntheticBackend`]: a tiny deterministic stand-in for a model, for the engine's
//! unit tests of scheduling logic and for the bookkeeping benchmark. It is not a model
//! and never serves acceptance tests (those run the real CPU backend).
//!
//! It keeps a real paged "cache" (the token id at each position, reached through the
//! block tables), so a block-table or cache-accounting bug changes its outputs. The
//! target's logits at position `p` are a hash of the tokens at `p − 2, p − 1, p`, read
//! back from the cache. The MTP layers predict the target's greedy choice exactly
//! except on a hashed fraction of contexts (`mtp_error_pct`), so acceptance is partial;
//! the fraction also hashes the MTP layer's own cache entries before the row, so a
//! wrong MTP cache entry changes drafts.
//! A [`SynthCost`] gives its calls a duration on the backend's own clock
//! ([`Backend::now`]), for tests of choices that follow the measured step times
//! (adaptive speculation): the times are the same on a loaded machine as on an idle one.
//!
//! Also what the backends' engine tests share: [`random_requests`], a seeded workload,
//! and [`run_to_completion`].

use crate::{Engine, Event, FinishReason, Request, RequestId, SamplingParams};
use mlaserve_core::{Backend, Batch, ForwardOutput, ModelConfig, BLOCK_SIZE};
use std::collections::HashMap;
use std::time::{Duration, Instant};

const NO_TOKEN: u32 = u32::MAX;

/// How long the synthetic backend's calls take on its clock: a fixed part per call and
/// a part per token of the batch, for the target forward and for an MTP forward, plus
/// up to `jitter_us` more per call (a hash of the call's number: timing noise that is
/// the same on every run). All zero (the default): the clock is wall time.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SynthCost {
    pub forward_call_us: u64,
    pub forward_token_us: u64,
    pub mtp_call_us: u64,
    pub mtp_token_us: u64,
    pub jitter_us: u64,
    /// The first call of each kind at each token count costs this much more and counts
    /// as a graph capture ([`Backend::graph_captures`]), as the CUDA backend's first step
    /// at a new shape does.
    pub capture_us: u64,
}

/// Deterministic toy backend (see the module docs).
#[derive(Debug)]
pub struct SyntheticBackend {
    config: ModelConfig,
    num_blocks: usize,
    cache: Vec<u32>,
    /// Percent of contexts in which the MTP prediction is deliberately wrong.
    pub mtp_error_pct: u64,
    /// Make the next target forward fail (tests the error path).
    pub fail_next_forward: bool,
    pub forward_calls: u64,
    pub mtp_calls: u64,
    /// Target tokens in chunks marked `prefill`, and in the others (decode windows), and
    /// the longest unmarked chunk.
    pub prefill_tokens: u64,
    pub window_tokens: u64,
    pub longest_window: usize,
    /// Duration of each call on the backend's clock (see [`SynthCost`]).
    pub cost: SynthCost,
    /// The clock's start and the time its calls have taken since, under a cost.
    epoch: Instant,
    clock_us: u64,
    /// Per MTP layer, an entry per cache slot (see `mtp_forward`).
    mtp_cache: Vec<Vec<u64>>,
    /// Shapes (MTP call?, tokens or padded sequences, window) already "captured" under
    /// [`SynthCost::capture_us`].
    captured: std::collections::HashSet<(bool, usize, usize)>,
    /// The CUDA backend's graph batch sizes ([`Backend::graph_batch_sizes`]), if set: a
    /// call's shape is then its sequence count padded to the next of them and its window
    /// (calls whose windows differ, or past the last size, never capture), as the CUDA
    /// backend keys its graphs; unset, the shape is the call's token count.
    pub graph_sizes: Vec<usize>,
    /// Keep a drafting pass's drafts in slots ([`Backend::keeps_drafts`]), as the CUDA
    /// backend does on its device.
    pub keep_drafts: bool,
    /// Drafting passes whose kept drafts were read.
    pub passes_kept: u64,
    slots: Vec<u32>,
}

fn mix(a: u64, b: u64) -> u64 {
    crate::rng::mix64(a ^ crate::rng::mix64(b))
}

impl SyntheticBackend {
    /// A backend with `vocab` tokens (eos id 1), `n_mtp` MTP layers, and `num_blocks`
    /// cache blocks.
    pub fn new(vocab: usize, n_mtp: usize, num_blocks: usize, max_positions: usize) -> Self {
        let json = format!(
            r#"{{"architectures":["DeepseekV3ForCausalLM"],"vocab_size":{vocab},"hidden_size":8,
            "intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":1,"kv_lora_rank":4,
            "qk_nope_head_dim":4,"qk_rope_head_dim":2,"v_head_dim":4,"rope_theta":10000.0,
            "max_position_embeddings":{max_positions},"num_nextn_predict_layers":{n_mtp},
            "eos_token_id":1}}"#
        );
        let config = match ModelConfig::from_json_str(&json) {
            Ok(c) => c,
            Err(e) => panic!("synthetic config must parse: {e}"),
        };
        SyntheticBackend {
            config,
            num_blocks,
            cache: vec![NO_TOKEN; num_blocks * BLOCK_SIZE],
            mtp_error_pct: 25,
            fail_next_forward: false,
            forward_calls: 0,
            mtp_calls: 0,
            prefill_tokens: 0,
            window_tokens: 0,
            longest_window: 0,
            cost: SynthCost::default(),
            epoch: Instant::now(),
            clock_us: 0,
            mtp_cache: vec![vec![0; num_blocks * BLOCK_SIZE]; n_mtp],
            captured: std::collections::HashSet::new(),
            graph_sizes: Vec::new(),
            keep_drafts: false,
            passes_kept: 0,
            slots: vec![NO_TOKEN; mlaserve_core::MAX_DRAFT_SLOTS],
        }
    }

    /// `batch` with its linked rows' tokens read from the draft slots (a slot never
    /// stored is an error: the drafter linked a draft no earlier stage made).
    fn resolve_links(&self, batch: &Batch) -> mlaserve_core::Result<Batch> {
        let mut b = batch.clone();
        let mut at = Vec::with_capacity(b.num_tokens());
        for (i, c) in b.seqs.iter().enumerate() {
            at.extend((0..c.tokens.len()).map(|j| (i, j)));
        }
        for &(row, slot) in &batch.draft_links {
            let t = self.slots[slot as usize];
            if t == NO_TOKEN {
                return Err(mlaserve_core::Error::Batch(format!("draft slot {slot} read before it was stored")));
            }
            let (i, j) = at[row as usize];
            b.seqs[i].tokens[j] = t;
        }
        b.draft_links.clear();
        Ok(b)
    }

    /// Advances the clock by one call of `call_us` plus `token_us` per token (plus a
    /// capture's cost at a new shape, under [`SynthCost::capture_us`]).
    fn spend(&mut self, mtp: bool, call_us: u64, token_us: u64, batch: &Batch) {
        let tokens = batch.num_tokens();
        if self.cost.capture_us > 0 && self.shape(batch).is_some_and(|s| self.captured.insert((mtp, s.0, s.1))) {
            self.clock_us += self.cost.capture_us;
        }
        let calls = self.forward_calls + self.mtp_calls;
        let jitter = if self.cost.jitter_us > 0 { mix(calls, 0x717) % (self.cost.jitter_us + 1) } else { 0 };
        self.clock_us += call_us + token_us * tokens as u64 + jitter;
    }

    /// The shape a call is captured as, if it is (see [`SyntheticBackend::graph_sizes`]).
    fn shape(&self, batch: &Batch) -> Option<(usize, usize)> {
        if self.graph_sizes.is_empty() {
            return Some((batch.num_tokens(), 0));
        }
        let w = batch.seqs.first()?.tokens.len();
        if batch.seqs.iter().any(|s| s.tokens.len() != w || s.prefill) {
            return None;
        }
        Some((*self.graph_sizes.iter().find(|&&n| n >= batch.seqs.len())?, w))
    }

    /// Captures so far of target calls (`mtp` false) or MTP calls.
    pub fn captures_of(&self, mtp: bool) -> usize {
        self.captured.iter().filter(|c| c.0 == mtp).count()
    }

    /// Logits of the target for the context (t[p−2], t[p−1], t[p]).
    fn logits_for(&self, ctx: u64, out: &mut Vec<f32>) {
        let v = self.config.vocab_size as u64;
        out.extend((0..v).map(|t| (mix(ctx, t) >> 40) as f32 / (1u64 << 24) as f32 * 4.0));
    }

    fn greedy(&self, ctx: u64) -> u32 {
        let mut row = Vec::new();
        self.logits_for(ctx, &mut row);
        crate::sampling::argmax(&row)
    }

    fn ctx(a: u32, b: u32, c: u32) -> u64 {
        mix(mix(a as u64, b as u64), c as u64)
    }

    fn one_hot(&self, tok: u32, out: &mut Vec<f32>) {
        let v = self.config.vocab_size;
        out.extend((0..v).map(|t| if t as u32 == tok { 1.0 } else { 0.0 }));
    }

    /// The sampled token of each of `batch.sample_rows`, the core rule applied to the row
    /// that `fill(row index, buffer)` writes.
    fn sample_rows(&self, batch: &Batch, fill: impl Fn(usize, &mut Vec<f32>)) -> Vec<u32> {
        let mut row = Vec::with_capacity(self.config.vocab_size);
        batch
            .sample_rows
            .iter()
            .map(|s| {
                row.clear();
                fill(s.row as usize, &mut row);
                s.sample(&row)
            })
            .collect()
    }
}

/// Hidden rows: the two tokens before the next one, packed `(older << 32) | newer`.
impl Backend for SyntheticBackend {
    type Hidden = Vec<u64>;

    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    fn forward(&mut self, batch: &Batch) -> mlaserve_core::Result<ForwardOutput<Vec<u64>>> {
        batch.validate(self.config.vocab_size, self.num_blocks, self.config.max_position_embeddings)?;
        batch.validate_kept(false)?;
        self.forward_calls += 1;
        let c = self.cost;
        self.spend(false, c.forward_call_us, c.forward_token_us, batch);
        if std::mem::take(&mut self.fail_next_forward) {
            return Err(mlaserve_core::Error::Backend("injected failure".into()));
        }
        for s in &batch.seqs {
            for (i, &t) in s.tokens.iter().enumerate() {
                let p = s.start_pos + i;
                self.cache[s.block_table[p / BLOCK_SIZE] as usize * BLOCK_SIZE + p % BLOCK_SIZE] = t;
            }
            if s.prefill {
                self.prefill_tokens += s.tokens.len() as u64;
            } else {
                self.window_tokens += s.tokens.len() as u64;
                self.longest_window = self.longest_window.max(s.tokens.len());
            }
        }
        let mut hidden = Vec::with_capacity(batch.num_tokens());
        let mut row_ctx = Vec::with_capacity(batch.num_tokens());
        for s in &batch.seqs {
            let read = |p: usize| -> mlaserve_core::Result<u32> {
                let t = self.cache[s.block_table[p / BLOCK_SIZE] as usize * BLOCK_SIZE + p % BLOCK_SIZE];
                if t == NO_TOKEN {
                    return Err(mlaserve_core::Error::Backend(format!("read of unwritten position {p}")));
                }
                Ok(t)
            };
            for i in 0..s.tokens.len() {
                let p = s.start_pos + i;
                let a = if p >= 2 { read(p - 2)? } else { NO_TOKEN - 1 };
                let b = if p >= 1 { read(p - 1)? } else { NO_TOKEN - 1 };
                let c = read(p)?;
                hidden.push(((b as u64) << 32) | c as u64);
                row_ctx.push(Self::ctx(a, b, c));
            }
        }
        let mut logits = Vec::with_capacity(batch.logit_rows.len() * self.config.vocab_size);
        for &r in &batch.logit_rows {
            self.logits_for(row_ctx[r as usize], &mut logits);
        }
        if !batch.edits.is_empty() || !batch.logprob_rows.is_empty() {
            let c = mlaserve_core::host_choices(batch, |r, row| self.logits_for(row_ctx[r as usize], row));
            return Ok(ForwardOutput { hidden, logits, argmax: c.argmax, sampled: c.sampled, logprobs: c.logprobs });
        }
        let argmax = batch.argmax_rows.iter().map(|&r| self.greedy(row_ctx[r as usize])).collect();
        let sampled = self.sample_rows(batch, |r, row| self.logits_for(row_ctx[r], row));
        Ok(ForwardOutput { hidden, logits, argmax, sampled, logprobs: Vec::new() })
    }

    fn mtp_forward(
        &mut self,
        layer: usize,
        batch: &Batch,
        prev: &Vec<u64>,
        hidden_rows: &[u32],
    ) -> mlaserve_core::Result<ForwardOutput<Vec<u64>>> {
        batch.validate(self.config.vocab_size, self.num_blocks, self.config.max_position_embeddings)?;
        batch.validate_kept(self.keep_drafts)?;
        let resolved;
        let batch = if batch.draft_links.is_empty() {
            batch
        } else {
            resolved = self.resolve_links(batch)?;
            &resolved
        };
        if layer >= self.config.num_nextn_predict_layers {
            return Err(mlaserve_core::Error::Batch(format!("no MTP layer {layer}")));
        }
        if hidden_rows.len() != batch.num_tokens() {
            return Err(mlaserve_core::Error::Batch("hidden_rows length != tokens".into()));
        }
        self.mtp_calls += 1;
        let c = self.cost;
        self.spend(true, c.mtp_call_us, c.mtp_token_us, batch);
        // The layer's own cache: every row writes an entry at its position (a hash of
        // its inputs), then reads every entry before it (attention), which decides
        // whether its prediction errs — so an entry that is not what the row's tokens
        // would have written (stale, or from another prefix) changes drafts, as it would
        // in a model.
        let slot = |c: &mlaserve_core::SeqChunk, p: usize| {
            c.block_table[p / BLOCK_SIZE] as usize * BLOCK_SIZE + p % BLOCK_SIZE
        };
        let mut row_in = Vec::with_capacity(batch.num_tokens());
        let mut r = 0;
        for c in &batch.seqs {
            for (i, &emb) in c.tokens.iter().enumerate() {
                let hr = hidden_rows[r];
                let h = *prev
                    .get(hr as usize)
                    .ok_or_else(|| mlaserve_core::Error::Batch(format!("hidden row {hr} out of range")))?;
                self.mtp_cache[layer][slot(c, c.start_pos + i)] = mix(h, emb as u64);
                row_in.push((h, emb));
                r += 1;
            }
        }
        let mut hidden = Vec::with_capacity(batch.num_tokens());
        let mut preds = Vec::with_capacity(batch.num_tokens());
        let rows = batch.seqs.iter().flat_map(|c| (0..c.tokens.len()).map(move |i| (c, c.start_pos + i)));
        for ((c, p), (h, emb)) in rows.zip(row_in) {
            let cache = &self.mtp_cache[layer];
            let before = (0..p).fold(0u64, |acc, q| acc.wrapping_add(cache[slot(c, q)]));
            let (a, b) = ((h >> 32) as u32, h as u32);
            let ctx = Self::ctx(a, b, emb);
            let mut pred = self.greedy(ctx);
            if mix(ctx ^ before, 0x5eed) % 100 < self.mtp_error_pct {
                pred = (pred + 1) % self.config.vocab_size as u32;
            }
            preds.push(pred);
            hidden.push(((b as u64) << 32) | emb as u64);
        }
        let mut logits = Vec::with_capacity(batch.logit_rows.len() * self.config.vocab_size);
        for &r in &batch.logit_rows {
            self.one_hot(preds[r as usize], &mut logits);
        }
        // The argmax of a one-hot row is its hot token.
        if !batch.edits.is_empty() || !batch.logprob_rows.is_empty() {
            let c = mlaserve_core::host_choices(batch, |r, row| self.one_hot(preds[r as usize], row));
            return Ok(ForwardOutput { hidden, logits, argmax: c.argmax, sampled: c.sampled, logprobs: c.logprobs });
        }
        let mut argmax: Vec<u32> = batch.argmax_rows.iter().map(|&r| preds[r as usize]).collect();
        if !batch.argmax_slots.is_empty() {
            for (&slot, &id) in batch.argmax_slots.iter().zip(&argmax) {
                self.slots[slot as usize] = id;
            }
            argmax.clear();
        }
        let sampled = self.sample_rows(batch, |r, row| self.one_hot(preds[r], row));
        Ok(ForwardOutput { hidden, logits, argmax, sampled, logprobs: Vec::new() })
    }

    fn keeps_drafts(&self) -> bool {
        self.keep_drafts
    }

    fn read_drafts(&mut self, n: usize) -> mlaserve_core::Result<Vec<u32>> {
        // A pass without drafts has none to read (the CUDA backend allocates its slots
        // at the first store): the engine must not ask.
        if !self.keep_drafts || n == 0 || n > self.slots.len() {
            return Err(mlaserve_core::Error::Batch(format!("{n} draft slots cannot be read")));
        }
        let ids = self.slots[..n].to_vec();
        self.passes_kept += 1;
        // A pass's slots are its own: the next one must store before it reads.
        self.slots[..n].fill(NO_TOKEN);
        Ok(ids)
    }

    fn hidden_to_host(&self, h: &Vec<u64>) -> mlaserve_core::Result<Vec<f32>> {
        Ok(h.iter().map(|&x| x as f32).collect())
    }

    fn concat_hidden(&mut self, parts: &[(&Vec<u64>, &[u32])]) -> mlaserve_core::Result<Vec<u64>> {
        let mut out = Vec::new();
        for (h, rows) in parts {
            for &r in *rows {
                out.push(
                    *h.get(r as usize)
                        .ok_or_else(|| mlaserve_core::Error::Batch(format!("hidden row {r} out of range")))?,
                );
            }
        }
        Ok(out)
    }

    fn now(&self) -> Instant {
        if self.cost == SynthCost::default() {
            Instant::now()
        } else {
            self.epoch + Duration::from_micros(self.clock_us)
        }
    }

    fn graph_captures(&self) -> u64 {
        self.captured.len() as u64
    }

    fn graph_batch_sizes(&self) -> Vec<usize> {
        self.graph_sizes.clone()
    }
}

/// `n` greedy requests drawn from a xorshift stream seeded with `seed`: each a prompt of
/// 1 to `max_prompt` ids in `2..vocab`, then 1 to `max_new` new tokens.
pub fn random_requests(seed: u64, n: usize, max_prompt: usize, max_new: u32, vocab: u32) -> Vec<Request> {
    let mut s = seed;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    (0..n)
        .map(|_| {
            let len = 1 + (next() % max_prompt as u64) as usize;
            let prompt = (0..len).map(|_| 2 + (next() % (vocab as u64 - 2)) as u32).collect();
            let params = SamplingParams { max_new_tokens: 1 + (next() % max_new as u64) as u32, ..Default::default() };
            Request::new(prompt, params)
        })
        .collect()
}

/// Steps `e` until every request of `ids` finishes; each one's tokens, in `ids` order,
/// or the message of the first request that ended in an error (the group's too).
pub fn run_to_completion<B: Backend>(e: &mut Engine<B>, ids: &[RequestId]) -> Result<Vec<Vec<u32>>, String> {
    let mut out: HashMap<_, Vec<u32>> = HashMap::new();
    let mut done = 0;
    while done < ids.len() {
        for (id, ev) in e.step() {
            match ev {
                Event::Tokens(t) => out.entry(id).or_default().extend(t),
                Event::Finished { reason: FinishReason::Error(m) | FinishReason::Unavailable(m), .. } => {
                    return Err(format!("request {id} failed: {m}"))
                }
                Event::Finished { .. } => done += 1,
                Event::Logprobs(_) => {}
            }
        }
    }
    Ok(ids.iter().map(|id| out.remove(id).unwrap_or_default()).collect())
}
