//! The experiment `TpLeader::plan_per_pass`: a drafting pass whose drafts stay on the
//! device crosses to the followers as one plan. A TP-2 group of synthetic backends that
//! keep their drafts (as the CUDA backend does) must give the single backend's greedy
//! output with the experiment off and on, its follower must run every call the leader
//! runs, and with it on the group must send fewer plans: at most two a decode step (the
//! verification's forward, then the pass).

use mlaserve_core::Result;
use mlaserve_engine::testing::SyntheticBackend;
use mlaserve_engine::{Engine, EngineConfig, Event, Request, SamplingParams};
use mlaserve_tp::{LocalGroup, PlanChannel, Plans, TpLeader};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const BLOCKS: usize = 256;

fn backend() -> SyntheticBackend {
    let mut b = SyntheticBackend::new(600, 3, BLOCKS, 1024);
    b.keep_drafts = true;
    b
}

/// Counts the plans a channel sends.
struct Counted<C> {
    inner: C,
    sent: Arc<AtomicU64>,
}

impl<C: PlanChannel> PlanChannel for Counted<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn timeout(&self) -> Option<Duration> {
        self.inner.timeout()
    }
    fn send_plan(&self, words: &[u32]) -> Result<()> {
        self.sent.fetch_add(1, Ordering::Relaxed);
        self.inner.send_plan(words)
    }
    fn receive_plan(&self) -> Result<Vec<u32>> {
        self.inner.receive_plan()
    }
}

fn workload() -> Vec<Request> {
    let mut s = 99u64;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    (0..24)
        .map(|_| {
            let len = 1 + (next() % 150) as usize;
            let prompt = (0..len).map(|_| 2 + (next() % 590) as u32).collect();
            let params = SamplingParams { max_new_tokens: 8 + (next() % 40) as u32, ..Default::default() };
            Request::new(prompt, params)
        })
        .collect()
}

/// Runs the workload at k = 3; returns each request's tokens and the engine's steps.
fn run<B: mlaserve_core::Backend>(backend: B) -> (Vec<Vec<u32>>, u64, Engine<B>) {
    let cfg = EngineConfig { num_speculative_tokens: Some(3), max_batch_tokens: 256, ..Default::default() };
    let mut e = Engine::new(backend, cfg).expect("engine");
    let ids: Vec<_> = workload().into_iter().map(|r| e.add_request(r).expect("admit")).collect();
    let mut out: HashMap<_, Vec<u32>> = HashMap::new();
    let (mut done, mut steps) = (0, 0);
    while done < ids.len() {
        steps += 1;
        for (id, ev) in e.step() {
            match ev {
                Event::Tokens(t) => out.entry(id).or_default().extend(t),
                Event::Finished { reason, .. } => {
                    assert!(
                        !matches!(
                            reason,
                            mlaserve_engine::FinishReason::Error(_) | mlaserve_engine::FinishReason::Unavailable(_)
                        ),
                        "{reason:?}"
                    );
                    done += 1;
                }
                Event::Logprobs(_) => {}
            }
        }
    }
    (ids.iter().map(|id| out.remove(id).unwrap_or_default()).collect(), steps, e)
}

#[test]
fn a_drafting_pass_crosses_as_one_plan_and_changes_no_output() {
    let (want, _, single) = run(backend());
    let single = single.backend();
    assert!(single.passes_kept > 10, "the single backend kept its drafts in {} passes", single.passes_kept);
    let mut plans_per_step = Vec::new();
    for per_pass in [false, true] {
        let mut groups = LocalGroup::new(2, Duration::from_secs(60));
        let follower_end = Plans::connect(groups.pop().expect("rank 1"), false).expect("channel").0;
        let leader_end = Plans::connect(groups.pop().expect("rank 0"), false).expect("channel").0;
        let follower = std::thread::spawn(move || {
            let mut b = backend();
            mlaserve_tp::run_follower(&mut b, &follower_end).map(|()| b)
        });
        let sent = Arc::new(AtomicU64::new(0));
        let plans = Counted { inner: leader_end, sent: sent.clone() };
        let leader = TpLeader::new(backend(), plans).expect("leader").plan_per_pass(per_pass);
        let (got, steps, mut e) = run(leader);
        assert_eq!(got, want, "TP 2 (plan per pass: {per_pass}) differs from one backend");
        let (mtp, fwd) = (e.backend().inner().mtp_calls, e.backend().inner().forward_calls);
        e.backend_mut().shutdown().expect("shutdown");
        let f = follower.join().expect("follower thread").expect("follower");
        assert_eq!((f.mtp_calls, f.forward_calls), (mtp, fwd), "the follower ran what the leader ran");
        plans_per_step.push(sent.load(Ordering::Relaxed) as f64 / steps as f64);
    }
    let (each, per_pass) = (plans_per_step[0], plans_per_step[1]);
    assert!(per_pass <= 2.1 && per_pass < 0.6 * each, "plans a step: {each:.2} per call, {per_pass:.2} per pass");
}
