//! A step crosses to a follower as one plan — its target forward, with the drafting pass
//! after it planned — and the follower resolves the pass with its own choices and
//! builds every stage's batch itself. On the synthetic backend (deterministic, no collectives
//! needed) the follower's calls must equal the leader's call for call — every batch,
//! hidden-row list and joined hidden state — with drafts read back to the host and
//! kept in device slots, for every k and number of MTP layers and with k changing from
//! step to step, through preemptions and prefix-cache hits; and the output equals one
//! rank's alone.

use mlaserve_core::{Backend, Batch, ForwardOutput, ModelConfig};
use mlaserve_engine::testing::{random_requests, run_to_completion, SyntheticBackend};
use mlaserve_engine::{Engine, EngineConfig, Request, Speculation};
use mlaserve_tp::{LocalGroup, TpLeader};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Cache blocks of a rank: fewer than the requests that run at once need, so some are
/// preempted.
const BLOCKS: usize = 16;

/// One backend call, as the backend received it.
#[derive(Debug, Clone, PartialEq)]
enum Call {
    Forward(Batch),
    Mtp { layer: usize, batch: Batch, prev: Vec<u64>, rows: Vec<u32> },
    Concat(Vec<(Vec<u64>, Vec<u32>)>),
}

type Log = Arc<Mutex<Vec<Call>>>;

/// The synthetic backend, logging every call.
struct Recording {
    inner: SyntheticBackend,
    log: Log,
}

impl Recording {
    fn new(n_mtp: usize, keep: bool) -> (Self, Log) {
        let mut inner = SyntheticBackend::new(64, n_mtp, BLOCKS, 4096);
        inner.keep_drafts = keep;
        let log = Log::default();
        (Recording { inner, log: log.clone() }, log)
    }

    fn note(&self, c: Call) {
        self.log.lock().expect("log").push(c);
    }
}

impl Backend for Recording {
    type Hidden = Vec<u64>;
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn num_blocks(&self) -> usize {
        self.inner.num_blocks()
    }
    fn forward(&mut self, batch: &Batch) -> mlaserve_core::Result<ForwardOutput<Vec<u64>>> {
        self.note(Call::Forward(batch.clone()));
        self.inner.forward(batch)
    }
    fn mtp_forward(
        &mut self,
        layer: usize,
        batch: &Batch,
        prev: &Vec<u64>,
        rows: &[u32],
    ) -> mlaserve_core::Result<ForwardOutput<Vec<u64>>> {
        self.note(Call::Mtp { layer, batch: batch.clone(), prev: prev.clone(), rows: rows.to_vec() });
        self.inner.mtp_forward(layer, batch, prev, rows)
    }
    fn hidden_to_host(&self, h: &Vec<u64>) -> mlaserve_core::Result<Vec<f32>> {
        self.inner.hidden_to_host(h)
    }
    fn concat_hidden(&mut self, parts: &[(&Vec<u64>, &[u32])]) -> mlaserve_core::Result<Vec<u64>> {
        self.note(Call::Concat(parts.iter().map(|(h, r)| ((*h).clone(), r.to_vec())).collect()));
        self.inner.concat_hidden(parts)
    }
    fn keeps_drafts(&self) -> bool {
        self.inner.keeps_drafts()
    }
    fn read_drafts(&mut self, n: usize) -> mlaserve_core::Result<Vec<u32>> {
        self.inner.read_drafts(n)
    }
}

/// Prompts of 1 to 150 tokens (the longer ones prefilled in chunks), every third
/// request sampled with a seed, every fourth (the first included) starting with the
/// same 140 tokens (two blocks, cached for the later ones).
fn workload() -> Vec<Request> {
    let mut r = random_requests(777, 12, 150, 48, 64);
    let shared: Vec<u32> = (0..140).map(|i| 2 + (i * 7) % 60).collect();
    for (i, x) in r.iter_mut().enumerate() {
        if i % 3 == 0 {
            x.sampling.temperature = 0.8;
            x.sampling.seed = Some(i as u64);
        }
        if i % 4 == 0 {
            x.prompt.splice(0..0, shared.iter().copied());
        }
    }
    r
}

/// Runs the workload with k forced through `pattern`; returns each request's tokens,
/// and the preemptions and prompt tokens found cached.
fn run<B: Backend>(e: &mut Engine<B>, pattern: &[usize]) -> (Vec<Vec<u32>>, u64, u64) {
    e.force_k(pattern);
    let ids: Vec<_> = workload().into_iter().map(|r| e.add_request(r).expect("admit")).collect();
    let out = run_to_completion(e, &ids).expect("run");
    let t = e.stats().totals;
    (out, t.preemptions, t.cached_prompt_tokens)
}

fn config(k: usize) -> EngineConfig {
    EngineConfig {
        num_speculative_tokens: Some(k),
        speculation: Speculation::Adaptive,
        max_batch_tokens: 96,
        max_num_seqs: 8,
        ..Default::default()
    }
}

#[test]
fn a_follower_builds_every_stage_as_the_leader_does() {
    let (mut preempted, mut cached) = (0, 0);
    for n_mtp in 1..=3 {
        for k in 1..=4 {
            // k changes between steps (0 included), so requests go on with rows kept
            // from a pass of another k, or from none.
            let pattern = [k, k, 0, k, k.max(2) - 1, k];
            for keep in [false, true] {
                let what = format!("{n_mtp} MTP layer(s), k = {k}, drafts kept on the device: {keep}");
                let mut alone = Engine::new(Recording::new(n_mtp, keep).0, config(k)).expect("engine");
                let (want, p, c) = run(&mut alone, &pattern);
                (preempted, cached) = (preempted + p, cached + c);
                let (leader, leader_log) = Recording::new(n_mtp, keep);
                let (mut follower, follower_log) = Recording::new(n_mtp, keep);
                let mut g = LocalGroup::new(2, Duration::from_secs(30));
                let (c1, c0) = (g.pop().expect("rank 1"), g.pop().expect("rank 0"));
                let got = std::thread::scope(|s| {
                    let f = s.spawn(move || mlaserve_tp::run_follower(&mut follower, &c1));
                    let mut e = Engine::new(TpLeader::new(leader, c0).expect("leader"), config(k)).expect("engine");
                    let got = run(&mut e, &pattern).0;
                    let (plans, steps) = (e.backend().plans_sent(), e.stats().times.steps);
                    e.backend_mut().shutdown().expect("shutdown");
                    f.join().expect("follower thread").expect("follower");
                    assert_eq!(plans, steps, "{what}: {plans} plans for {steps} steps");
                    got
                });
                assert_eq!(got, want, "{what}: TP output differs from one rank's");
                let (l, f) = (leader_log.lock().expect("log"), follower_log.lock().expect("log"));
                assert_eq!(l.len(), f.len(), "{what}: calls");
                for (i, (a, b)) in l.iter().zip(f.iter()).enumerate() {
                    assert_eq!(a, b, "{what}: call {i}");
                }
                // The passes ran what this case is about.
                let mtp = |p: &dyn Fn(usize, &Batch) -> bool| {
                    l.iter().any(|c| matches!(c, Call::Mtp { layer, batch, .. } if p(*layer, batch)))
                };
                assert!(mtp(&|layer, _| layer + 1 == n_mtp.min(k)), "{what}: every full stage ran");
                assert_eq!(mtp(&|_, b| !b.draft_links.is_empty()), keep && k > 1, "{what}: linked drafts");
                let joined = l.iter().any(|c| matches!(c, Call::Concat(_)));
                assert_eq!(joined, n_mtp > 1 && k > 1, "{what}: rows kept from the pass before");
            }
        }
    }
    assert!(preempted > 0 && cached > 0, "{preempted} preemptions, {cached} prompt tokens cached");
}
