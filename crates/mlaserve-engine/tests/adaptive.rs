//! Adaptive speculation (`Speculation::Adaptive`) on the synthetic backend with timed
//! calls (`SynthCost`, on the backend's own clock): the k it chooses follows the step times it measures — the
//! most drafts where a step costs the same whatever its window, none where it costs in
//! proportion to its tokens or where drafts are rarely accepted — and the output is the
//! fixed k = 0 output whatever it chooses, greedy and seeded sampling alike.

mod common;

use common::{random_arrivals, run_all, Arrival, TestRng};
use mlaserve_core::Backend as _;
use mlaserve_engine::testing::{SynthCost, SyntheticBackend};
use mlaserve_engine::{Engine, EngineConfig, SamplingParams, SpecStats, Speculation};

const VOCAB: usize = 64;

/// The MTP layers, block pool, token budget and most running requests of an engine.
#[derive(Clone, Copy)]
struct Size {
    n_mtp: usize,
    blocks: usize,
    budget: usize,
    seqs: usize,
}

const ROOMY: Size = Size { n_mtp: 2, blocks: 2048, budget: 1024, seqs: 64 };

fn engine(cost: SynthCost, speculation: Speculation, k: usize) -> Engine<SyntheticBackend> {
    engine_of(ROOMY, cost, speculation, k)
}

fn engine_of(size: Size, cost: SynthCost, speculation: Speculation, k: usize) -> Engine<SyntheticBackend> {
    let mut b = SyntheticBackend::new(VOCAB, size.n_mtp, size.blocks, 4096);
    b.cost = cost;
    let cfg = EngineConfig {
        num_speculative_tokens: Some(k),
        speculation,
        max_batch_tokens: size.budget,
        max_num_seqs: size.seqs,
        ..Default::default()
    };
    Engine::new(b, cfg).expect("engine")
}

/// 24 requests arriving together, 200 tokens each (EOS ignored): the batch stays at 24
/// rows for most of the run.
fn arrivals(sampling: &SamplingParams) -> Vec<Arrival> {
    let sp = SamplingParams { ignore_eos: true, ..sampling.clone() };
    random_arrivals(&mut TestRng(7), 24, VOCAB as u32, (4, 40), (200, 200), 0, &sp)
        .into_iter()
        .enumerate()
        .map(|(i, mut a)| {
            a.req.sampling.seed = Some(500 + i as u64);
            a
        })
        .collect()
}

fn share(st: &SpecStats, k: usize) -> f64 {
    st.steps_per_k[k] as f64 / st.steps_per_k.iter().sum::<u64>() as f64
}

#[test]
fn adaptive_k_follows_the_measured_costs_and_never_changes_the_output() {
    let greedy = arrivals(&SamplingParams::default());
    let sampled = arrivals(&SamplingParams { temperature: 1.0, top_k: 20, ..Default::default() });
    // Memory-bound (a GPU decoding a small batch): a step costs the same whatever its
    // window, an MTP pass a fortieth of it, each call up to 10% longer (noise). Three
    // drafts then serve ~13% more tokens per second than two at the synthetic
    // drafter's rates, past the 5% margin.
    let flat = SynthCost { forward_call_us: 4000, mtp_call_us: 100, jitter_us: 400, ..Default::default() };
    // The same with an MTP pass a tenth of a step: at the ~7% acceptance of sampled
    // tokens (the synthetic drafter predicts the greedy token) one draft loses.
    let flat_mtp = SynthCost { mtp_call_us: 400, ..flat };
    // Compute-bound (the CPU): cost in proportion to the tokens, MTP layers included.
    let per_token = SynthCost { forward_token_us: 150, mtp_token_us: 150, jitter_us: 400, ..Default::default() };
    let cases = [(&greedy, [(flat, 3), (per_token, 0)]), (&sampled, [(flat_mtp, 0), (per_token, 0)])];
    for (a, costs) in cases {
        let what = if a[0].req.sampling.temperature > 0.0 { "seeded sampling" } else { "greedy" };
        let base = run_all(&mut engine(SynthCost::default(), Speculation::Fixed, 0), a);
        for (cost, want_k) in costs {
            let mut e = engine(cost, Speculation::Adaptive, 3);
            let out = run_all(&mut e, a);
            for (i, (x, y)) in base.iter().zip(&out).enumerate() {
                assert_eq!(x.tokens, y.tokens, "{what}, {cost:?}: request {i} differs from k = 0");
                assert_eq!(x.reason, y.reason, "{what}, {cost:?}: request {i}");
            }
            let st = e.stats().speculation;
            eprintln!("{what}, {cost:?}: steps per k {:?}, rates {:?}", st.steps_per_k, st.rates);
            assert!(share(&st, want_k) >= 0.6, "{what}, {cost:?}: k = {want_k} chosen too rarely: {st:?}");
            if want_k > 0 {
                // The expectation the choice was made on matches what verification did.
                let (x, r) = (st.expected_accepted, st.realised_accepted as f64);
                assert!((x - r).abs() <= 0.25 * r, "{what}: expected {x:.0} accepted drafts, verified {r}");
            }
        }
    }
}

/// A backend whose first call at each shape captures a CUDA graph (costing several steps'
/// time, once): those steps are no cost samples, so the choice still follows the steady
/// costs. Counted, a capture's cost made k = 2 and 3 look dear, and the periodic
/// re-measurements reach only the choice's neighbours.
#[test]
fn graph_captures_are_kept_out_of_the_costs() {
    let a = arrivals(&SamplingParams::default());
    let flat = SynthCost { forward_call_us: 4000, mtp_call_us: 100, jitter_us: 400, ..Default::default() };
    let base = run_all(&mut engine(SynthCost::default(), Speculation::Fixed, 0), &a);
    let mut e = engine(SynthCost { capture_us: 40_000, ..flat }, Speculation::Adaptive, 3);
    let out = run_all(&mut e, &a);
    assert!(e.backend().graph_captures() > 10, "the synthetic backend captured nothing");
    for (i, (x, y)) in base.iter().zip(&out).enumerate() {
        assert_eq!(x.tokens, y.tokens, "request {i} differs from k = 0");
    }
    let st = e.stats().speculation;
    eprintln!("captures on: steps per k {:?}", st.steps_per_k);
    assert!(share(&st, 3) >= 0.6, "k = 3 chosen too rarely: {st:?}");
}

/// Fixed k takes the maximum at every step, as before.
#[test]
fn fixed_k_drafts_every_step() {
    let a = arrivals(&SamplingParams::default());
    let mut e = engine(SynthCost::default(), Speculation::Fixed, 2);
    run_all(&mut e, &a);
    let st = e.stats().speculation;
    assert_eq!(st.steps_per_k[..2], [0, 0], "{st:?}");
    assert!(st.steps_per_k[2] > 0);
    assert_eq!(e.stats().totals.draft_tokens, 2 * e.stats().totals.decode_steps);
}

/// k changing from step to step (costs nearly tied between 2 and 3 drafts, so the
/// choice follows the timing noise, `jitter_us`), with 1 to 3 MTP layers (the drafter's stages and
/// the rows it keeps between steps change with k), under preemption and a token budget
/// that leaves decodes out of some steps (they keep drafts of an older k): the output
/// is still the k = 0 output, and the block accounting holds at every step (`run_all`).
#[test]
fn changing_k_under_preemption_keeps_the_output() {
    let sp = SamplingParams::default();
    let a = random_arrivals(&mut TestRng(11), 48, VOCAB as u32, (1, 300), (1, 64), 40, &sp);
    let small = |n_mtp: usize, cost: SynthCost, speculation: Speculation, k: usize| {
        engine_of(Size { n_mtp, blocks: 14, budget: 128, seqs: 32 }, cost, speculation, k)
    };
    let base = run_all(&mut small(1, SynthCost::default(), Speculation::Fixed, 0), &a);
    let tied = SynthCost { forward_call_us: 1000, mtp_call_us: 250, jitter_us: 100, ..Default::default() };
    for n_mtp in 1..=3 {
        let mut e = small(n_mtp, tied, Speculation::Adaptive, 4);
        let out = run_all(&mut e, &a);
        for (i, (x, y)) in base.iter().zip(&out).enumerate() {
            assert_eq!(x.tokens, y.tokens, "{n_mtp} MTP layers: request {i}");
            assert_eq!(x.reason, y.reason, "{n_mtp} MTP layers: request {i}");
        }
        let st = e.stats();
        eprintln!(
            "{n_mtp} MTP layers: steps per k {:?}, preemptions {}",
            st.speculation.steps_per_k, st.totals.preemptions
        );
        assert!(st.totals.preemptions > 0, "the pool is small enough to preempt");
        assert!(st.speculation.steps_per_k.iter().filter(|&&n| n > 0).count() >= 3, "{:?}", st.speculation);
    }
}

/// A start-up calibration (`Engine::calibrate`) measures every k at 1, 2, 4, … rows (32
/// prompts take more than one step of the budget) on
/// throwaway requests and leaves nothing else behind: the costs it measured follow the
/// backend's (a flat step: three drafts cost little more than none; a step in proportion
/// to its tokens: they cost several times more), and the engine then serves the same
/// output as k = 0 without first trying every k on the traffic (an uncalibrated engine
/// drafts three on its first decode; a calibrated one never does where drafts do not pay).
#[test]
fn a_calibration_measures_every_k_and_leaves_only_costs_behind() {
    let a = arrivals(&SamplingParams::default());
    let base = run_all(&mut engine(SynthCost::default(), Speculation::Fixed, 0), &a);
    let flat =
        SynthCost { forward_call_us: 4000, mtp_call_us: 100, jitter_us: 400, capture_us: 40_000, ..Default::default() };
    let per_token = SynthCost { forward_token_us: 150, mtp_token_us: 150, jitter_us: 400, ..Default::default() };
    for (cost, dear) in [(flat, false), (per_token, true)] {
        let mut e = engine(cost, Speculation::Adaptive, 3);
        let cal = e.calibrate(32).expect("calibration");
        assert_eq!(cal.rows, [1, 2, 4, 8, 16, 32], "{cost:?}: {cal:?}");
        assert_eq!(cal.stopped, None);
        let st = e.stats();
        let untouched = engine(cost, Speculation::Adaptive, 3).stats();
        assert_eq!(st.speculation.steps_per_k, [0; 4], "{cost:?}: the decisions are forgotten");
        assert_eq!((st.speculation.realised_accepted, st.finished_requests), (0, 0));
        assert_eq!(st.totals, untouched.totals, "{cost:?}: the throwaway requests count in the totals");
        assert_eq!(st.times.steps, 0);
        assert_eq!((st.prefix.queried_tokens, st.prefix.cached_blocks), (0, 0), "{cost:?}: {:?}", st.prefix);
        assert_eq!(st.load.kv_blocks_free, st.load.kv_blocks_total);
        assert!(!e.has_work());
        assert_eq!(st.speculation.costs.iter().map(|c| c.0).collect::<Vec<_>>(), [1, 2, 4, 8, 16, 32]);
        for (rows, c) in &st.speculation.costs {
            let c: Vec<f64> =
                c.iter().map(|c| c.unwrap_or_else(|| panic!("{cost:?}: {rows} rows: a k unmeasured"))).collect();
            let ratio = c[3] / c[0];
            eprintln!("{cost:?}: {rows} rows: {c:.0?} µs per row");
            if dear {
                assert!(ratio > 3.0, "{rows} rows: k = 3 costs {ratio:.2}x k = 0, the backend's tokens 4x");
            } else {
                assert!(ratio < 1.3, "{rows} rows: k = 3 costs {ratio:.2}x k = 0 on a flat step");
            }
        }
        let out = run_all(&mut e, &a);
        for (i, (x, y)) in base.iter().zip(&out).enumerate() {
            assert_eq!(x.tokens, y.tokens, "{cost:?}: request {i} differs from k = 0");
        }
        let st = e.stats().speculation;
        eprintln!("calibrated, {cost:?}: steps per k {:?}", st.steps_per_k);
        if dear {
            assert_eq!(st.steps_per_k[3], 0, "k = 3 tried where it costs 4x: {st:?}");
            let mut fresh = engine(cost, Speculation::Adaptive, 3);
            run_all(&mut fresh, &a);
            assert!(fresh.stats().speculation.steps_per_k[3] > 0, "an uncalibrated engine tries k = 3 first");
        } else {
            assert!(share(&st, 3) >= 0.6, "k = 3 chosen too rarely: {st:?}");
        }
    }
}

/// A graph warm-up (`Engine::warm_up_graphs`) runs every graph batch size at every k, so
/// that serving meets no target shape it has not captured: a backend that captures per
/// (padded batch size, window), as the CUDA backend does, captured target graphs while
/// serving without the warm-up and none after it (drafting passes may still meet a new
/// transition between two k); nothing else is left behind, and the output is k = 0's.
#[test]
fn a_graph_warm_up_leaves_serving_no_target_shape_to_capture() {
    let a = arrivals(&SamplingParams::default());
    let base = run_all(&mut engine(SynthCost::default(), Speculation::Fixed, 0), &a);
    // Near-tied costs, so the choice moves between k at every batch size.
    let cost = SynthCost {
        forward_call_us: 4000,
        forward_token_us: 20,
        mtp_call_us: 400,
        jitter_us: 800,
        capture_us: 10_000,
        ..Default::default()
    };
    let sizes = vec![1, 2, 4, 8, 16, 24, 32];
    for (speculation, k) in [(Speculation::Adaptive, 3), (Speculation::Fixed, 3)] {
        let mut cold = engine(cost, speculation, k);
        cold.backend_mut().graph_sizes = sizes.clone();
        run_all(&mut cold, &a);
        let cold_target = cold.backend().captures_of(false);
        let mut warm = engine(cost, speculation, k);
        warm.backend_mut().graph_sizes = sizes.clone();
        let w = warm.warm_up_graphs(64).expect("warm-up");
        assert_eq!(w.rows, sizes, "{speculation:?}: {w:?}");
        let (before, before_target) = (warm.backend().graph_captures(), warm.backend().captures_of(false));
        let st = warm.stats();
        assert_eq!((st.finished_requests, st.totals.generated_tokens, st.prefix.cached_blocks), (0, 0, 0));
        assert_eq!(st.speculation.steps_per_k.iter().sum::<u64>(), 0);
        let out = run_all(&mut warm, &a);
        for (i, (x, y)) in base.iter().zip(&out).enumerate() {
            assert_eq!(x.tokens, y.tokens, "{speculation:?}: request {i} differs from k = 0");
        }
        let after_target = warm.backend().captures_of(false) - before_target;
        let after = warm.backend().graph_captures() - before;
        eprintln!(
            "{speculation:?}: cold serving captured {cold_target} target graphs; warm-up {before}, then serving {after} ({after_target} target)"
        );
        assert!(cold_target > 0, "{speculation:?}: the cold engine captured no target graph while serving");
        assert_eq!(after_target, 0, "{speculation:?}: serving captured target graphs after the warm-up");
    }
}
