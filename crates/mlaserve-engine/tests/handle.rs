//! The async [`EngineHandle`]: streams, abort, abort on drop, load and stats, errors,
//! shutdown. Uses the synthetic backend (this tests the shell, not the model).

use mlaserve_engine::testing::SyntheticBackend;
use mlaserve_engine::{EngineConfig, EngineError, EngineHandle, Event, FinishReason, Request, SamplingParams};
use std::time::Duration;

async fn handle(blocks: usize, max_positions: usize) -> EngineHandle {
    let cfg = EngineConfig { num_speculative_tokens: Some(2), max_batch_tokens: 64, ..Default::default() };
    EngineHandle::spawn(move || Ok(SyntheticBackend::new(64, 2, blocks, max_positions)), cfg).await.expect("spawn")
}

fn req(n: u32) -> Request {
    Request::new(vec![5, 6, 7], SamplingParams { max_new_tokens: n, ignore_eos: true, ..Default::default() })
}

async fn collect(mut rx: tokio::sync::mpsc::Receiver<Event>) -> (Vec<u32>, FinishReason) {
    let mut toks = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Tokens(t) => toks.extend(t),
            Event::Finished { reason, usage } => {
                assert_eq!(usage.generated_tokens as usize, toks.len());
                assert!(rx.recv().await.is_none(), "nothing after Finished");
                return (toks, reason);
            }
            Event::Logprobs(_) => {}
        }
    }
    panic!("stream ended without Finished");
}

#[tokio::test]
async fn streams_abort_and_stats() {
    // Room for a long request that is still running when it gets aborted.
    let h = handle(256, 8192).await;
    assert_eq!(h.info().num_speculative_tokens, 2);
    let mut streams = Vec::new();
    for _ in 0..8 {
        streams.push(h.submit(req(30)).await.expect("submit"));
    }
    let (long_id, mut long_rx) = h.submit(req(100_000)).await.expect("submit");
    // Abort the long request while it is surely running: right after its first tokens.
    let first = match long_rx.recv().await {
        Some(Event::Tokens(t)) => t,
        other => panic!("expected tokens first, got {other:?}"),
    };
    assert!(!first.is_empty());
    h.abort(long_id).await.expect("abort");
    let mut outs = Vec::new();
    for (_, rx) in streams {
        outs.push(collect(rx).await);
    }
    for (t, r) in &outs {
        assert_eq!(t.len(), 30);
        assert_eq!(*r, FinishReason::Length);
        assert_eq!(t, &outs[0].0, "same prompt, greedy: same output");
    }
    let mut rest = Vec::new();
    let reason = loop {
        match long_rx.recv().await {
            Some(Event::Tokens(t)) => rest.extend(t),
            Some(Event::Finished { reason, usage }) => {
                assert_eq!(usage.generated_tokens as usize, first.len() + rest.len());
                break reason;
            }
            Some(Event::Logprobs(_)) => {}
            None => panic!("stream ended without Finished"),
        }
    };
    assert_eq!(reason, FinishReason::Abort);
    assert!(matches!(h.abort(long_id).await, Err(EngineError::UnknownRequest(_))));
    let st = h.stats().await.expect("stats");
    assert_eq!(st.finished_requests, 9);
    assert_eq!(st.load.kv_blocks_free, st.load.kv_blocks_total);
    assert!(st.totals.draft_tokens > 0 && st.times.steps > 0);
    match h.submit(Request::new(vec![], SamplingParams::default())).await {
        Err(EngineError::InvalidRequest { field, .. }) => assert_eq!(field, "prompt.token_ids"),
        other => panic!("{other:?}"),
    }
    h.shutdown().await.expect("shutdown");
    assert!(matches!(h.submit(req(1)).await, Err(EngineError::Stopped)));
}

#[tokio::test]
async fn dropping_the_stream_aborts() {
    let h = handle(16, 1024).await;
    let (_, rx) = h.submit(req(100_000)).await.expect("submit");
    let mut rx = rx;
    assert!(matches!(rx.recv().await, Some(Event::Tokens(_))));
    drop(rx);
    for _ in 0..200 {
        let st = h.stats().await.expect("stats");
        if st.finished_requests == 1 {
            assert_eq!(st.load.kv_blocks_free, st.load.kv_blocks_total);
            assert_eq!(h.load().running_requests, 0);
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the dropped request was not aborted");
}

#[tokio::test]
async fn backend_construction_error_is_reported() {
    let cfg = EngineConfig { num_speculative_tokens: Some(1), ..Default::default() };
    let r = EngineHandle::spawn(|| Ok(SyntheticBackend::new(64, 0, 16, 1024)), cfg).await;
    assert!(matches!(r, Err(EngineError::Config(_))));
    let r = EngineHandle::spawn(
        || Err::<SyntheticBackend, _>(mlaserve_core::Error::Backend("no device".into())),
        EngineConfig::default(),
    )
    .await;
    assert!(matches!(r, Err(EngineError::Backend(_))));
}

/// A stream read only after its request finished still holds every event: with logprobs
/// a `Logprobs` follows each `Tokens` (one token per step without drafts), and the
/// `Finished` at the end must not be dropped for want of room.
#[tokio::test]
async fn an_unread_stream_with_logprobs_keeps_its_finish() {
    let cfg = EngineConfig { num_speculative_tokens: Some(0), ..Default::default() };
    let h = EngineHandle::spawn(move || Ok(SyntheticBackend::new(64, 2, 64, 4096)), cfg).await.expect("spawn");
    let sp = SamplingParams { max_new_tokens: 40, ignore_eos: true, logprobs: Some(1), ..Default::default() };
    let (_, mut rx) = h.submit(Request::new(vec![5, 6, 7], sp)).await.expect("submit");
    // Wait until the engine is idle again: the request ran to its end unread.
    for _ in 0..500 {
        if h.stats().await.expect("stats").finished_requests == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (mut tokens, mut logprobs, mut finished) = (0, 0, false);
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Tokens(t) => tokens += t.len(),
            Event::Logprobs(l) => logprobs += l.len(),
            Event::Finished { reason, .. } => {
                assert_eq!(reason, FinishReason::Length);
                finished = true;
            }
        }
    }
    assert!(finished, "the Finished event was dropped");
    assert_eq!((tokens, logprobs), (40, 40));
}

/// A backend that raises a flag when dropped (the synthetic one inside).
struct Dropping(SyntheticBackend, std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Drop for Dropping {
    fn drop(&mut self) {
        // Slow enough that a reply sent before the drop would be seen first.
        std::thread::sleep(Duration::from_millis(200));
        self.1.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl mlaserve_core::Backend for Dropping {
    type Hidden = <SyntheticBackend as mlaserve_core::Backend>::Hidden;
    fn config(&self) -> &mlaserve_core::ModelConfig {
        self.0.config()
    }
    fn num_blocks(&self) -> usize {
        self.0.num_blocks()
    }
    fn forward(
        &mut self,
        b: &mlaserve_core::backend::Batch,
    ) -> mlaserve_core::Result<mlaserve_core::backend::ForwardOutput<Self::Hidden>> {
        self.0.forward(b)
    }
    fn mtp_forward(
        &mut self,
        layer: usize,
        b: &mlaserve_core::backend::Batch,
        prev: &Self::Hidden,
        rows: &[u32],
    ) -> mlaserve_core::Result<mlaserve_core::backend::ForwardOutput<Self::Hidden>> {
        self.0.mtp_forward(layer, b, prev, rows)
    }
    fn hidden_to_host(&self, h: &Self::Hidden) -> mlaserve_core::Result<Vec<f32>> {
        self.0.hidden_to_host(h)
    }
    fn concat_hidden(&mut self, parts: &[(&Self::Hidden, &[u32])]) -> mlaserve_core::Result<Self::Hidden> {
        self.0.concat_hidden(parts)
    }
}

/// `shutdown` returns only once the engine thread has dropped its backend: a worker exits
/// right after it, and a process torn down under a GPU backend's drop can crash.
#[tokio::test]
async fn shutdown_returns_after_the_backend_is_dropped() {
    let dropped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = dropped.clone();
    let cfg = EngineConfig { num_speculative_tokens: Some(2), max_batch_tokens: 64, ..Default::default() };
    let h = EngineHandle::spawn(move || Ok(Dropping(SyntheticBackend::new(64, 2, 256, 8192), flag)), cfg)
        .await
        .expect("spawn");
    let (_, rx) = h.submit(req(5)).await.expect("submit");
    assert_eq!(collect(rx).await.0.len(), 5);
    h.shutdown().await.expect("shutdown");
    assert!(dropped.load(std::sync::atomic::Ordering::SeqCst), "shutdown returned before the backend was dropped");
}

/// `EngineConfig::calibration_rows` calibrates the engine on its thread before `spawn`
/// returns: the first stats already hold a cost of every k at 1, 2 and 4 rows, and no
/// request, token or step; a calibrated engine then serves as usual.
#[tokio::test]
async fn a_calibration_runs_before_the_handle_is_ready() {
    use mlaserve_engine::Speculation;
    let cfg = EngineConfig {
        num_speculative_tokens: Some(2),
        speculation: Speculation::Adaptive,
        max_batch_tokens: 64,
        calibration_rows: 4,
        ..Default::default()
    };
    let h = EngineHandle::spawn(move || Ok(SyntheticBackend::new(64, 2, 256, 4096)), cfg).await.expect("spawn");
    let st = h.stats().await.expect("stats");
    let rows: Vec<usize> = st.speculation.costs.iter().map(|c| c.0).collect();
    assert_eq!(rows, [1, 2, 4], "{:?}", st.speculation);
    assert!(st.speculation.costs.iter().all(|(_, c)| c.iter().all(Option::is_some)), "{:?}", st.speculation);
    assert_eq!((st.finished_requests, st.totals.generated_tokens, st.times.steps), (0, 0, 0));
    assert_eq!(h.load().running_requests, 0);
    let (_, rx) = h.submit(req(20)).await.expect("submit");
    let (tokens, reason) = collect(rx).await;
    assert_eq!((tokens.len(), reason), (20, FinishReason::Length));
}
