//! `bench serve --workload shared-prefix`: multi-turn conversations over a few shared
//! system prompts — the traffic a prefix cache exists for. Each conversation opens with
//! one of the `--system-prompts` system prompts (drawn from a fixed seed); each turn
//! sends the whole conversation so far plus a new user message of `--prompt-tokens`
//! ids, and appends the reply; with `--think-time-ms` the user thinks before each turn
//! after the first (as vLLM's and Dynamo's multi-turn benchmarks let users do).

use crate::client::{bench_prompt, connect, report, timed_request, BenchArgs, BenchReport, ClientError, Sample};
use mlaserve_proto::v1::{generate_request::Prompt, GenerateRequest, StoppingCriteria, TokenIds};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The system prompts: `n` of them, lengths spread over `lo..=hi` tokens.
pub fn system_prompts(n: usize, (lo, hi): (usize, usize), vocab: u32) -> Vec<Vec<u32>> {
    (0..n.max(1))
        .map(|i| {
            let len = if n <= 1 { lo } else { lo + (hi - lo) * i / (n - 1) };
            bench_prompt(1_000_000 + i, len, vocab)
        })
        .collect()
}

/// The system prompt of conversation `c` among `n`: a fixed pseudo-random draw (not
/// `c mod n`, whose regular order a round-robin placement would follow by accident).
pub fn system_of(c: usize, n: usize) -> usize {
    let mut x = (c as u64 ^ 0x5bd1_e995).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 29;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 32;
    (x % n.max(1) as u64) as usize
}

/// Think time before turn `t` of conversation `c`: an exponential draw of mean `mean_ms`
/// from a fixed seed (none before the first turn, none with a mean of 0).
pub fn think_time(c: usize, t: usize, mean_ms: u64) -> Duration {
    if t == 0 || mean_ms == 0 {
        return Duration::ZERO;
    }
    let mut x = ((c as u64) << 20 ^ t as u64 ^ 0x7f4a_7c15).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 31;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 29;
    let u = ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    Duration::from_secs_f64(-u.ln() * mean_ms as f64 / 1e3)
}

/// Runs the conversations (closed loop: `--concurrency` at once, `--requests` turns in
/// all) and reports them like `bench serve`.
pub async fn conversations(args: &BenchArgs) -> Result<BenchReport, ClientError> {
    let mut clients = Vec::new();
    for _ in 0..args.connections.max(1) {
        clients.push(connect(&args.server).await?);
    }
    let systems = Arc::new(system_prompts(args.system_prompts, args.system_prompt_tokens, args.vocab));
    let turns = args.turns.max(1);
    let n_conv = args.requests.div_ceil(turns);
    let start = Instant::now();
    let deadline = start + Duration::from_secs(args.time_limit_s);
    let next = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..args.concurrency.max(1) {
        let mut client = clients[w % clients.len()].clone();
        let (systems, next, args) = (systems.clone(), next.clone(), args.clone());
        tasks.spawn(async move {
            let mut samples: Vec<Sample> = Vec::new();
            loop {
                let c = next.fetch_add(1, Ordering::Relaxed);
                if c >= n_conv || Instant::now() >= deadline {
                    return samples;
                }
                let mut history = systems[system_of(c, systems.len())].clone();
                for t in 0..turns.min(args.requests - c * turns) {
                    let think = think_time(c, t, args.think_time_ms);
                    if !think.is_zero() {
                        tokio::time::sleep_until((Instant::now() + think).min(deadline).into()).await;
                    }
                    history.extend(bench_prompt(2_000_000 + c * turns + t, args.prompt_tokens, args.vocab));
                    let req = GenerateRequest {
                        prompt: Some(Prompt::TokenIds(TokenIds { ids: history.clone() })),
                        stopping: Some(StoppingCriteria {
                            max_new_tokens: Some(args.max_new_tokens),
                            ignore_eos: true,
                            ..Default::default()
                        }),
                        ..Default::default()
                    };
                    let req = args.server.request(req);
                    let s = tokio::time::timeout_at(deadline.into(), timed_request(&mut client, req))
                        .await
                        .unwrap_or(Sample { error: Some(tonic::Code::DeadlineExceeded), ..Default::default() });
                    let failed = s.error.is_some();
                    history.extend_from_slice(&s.output);
                    samples.push(s);
                    if failed {
                        break;
                    }
                }
            }
        });
    }
    let mut samples = Vec::with_capacity(args.requests);
    while let Some(r) = tasks.join_next().await {
        if let Ok(s) = r {
            samples.extend(s);
        }
    }
    Ok(report(samples, start.elapsed()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn system_prompts_span_the_range_and_differ() {
        let s = system_prompts(8, (100, 200), 500);
        assert_eq!(s.len(), 8);
        assert_eq!((s[0].len(), s[7].len()), (100, 200));
        assert_ne!(s[0][..50], s[1][..50]);
        // Every system prompt is used, in no fixed order.
        let picks: Vec<usize> = (0..64).map(|c| system_of(c, 8)).collect();
        assert!((0..8).all(|i| picks.contains(&i)));
        assert!(picks.windows(2).any(|w| w[1] != (w[0] + 1) % 8));
    }

    #[test]
    fn think_times_are_exponential_of_the_mean_and_fixed_by_the_seed() {
        assert_eq!(think_time(3, 0, 500), Duration::ZERO, "no thinking before the first turn");
        assert_eq!(think_time(3, 2, 0), Duration::ZERO);
        assert_eq!(think_time(3, 2, 500), think_time(3, 2, 500));
        let draws: Vec<f64> = (0..4000).map(|i| think_time(i / 4, 1 + i % 4, 500).as_secs_f64() * 1e3).collect();
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!((mean / 500.0 - 1.0).abs() < 0.06, "mean {mean} ms");
        // An exponential's median is ln 2 of its mean.
        let below = draws.iter().filter(|&&d| d < 500.0 * std::f64::consts::LN_2).count();
        assert!((below as f64 / draws.len() as f64 - 0.5).abs() < 0.03, "{below} of {} below the median", draws.len());
    }
}
