//! Real `mlaserve` processes as an operator runs them: a worker stopped with SIGTERM
//! under load loses no request that had not started streaming and exits cleanly, and a
//! request's id is in the router's log.

mod common;

use common::{client, request, router, wait_serving, worker};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Sends `width` short requests at a time until `stop`; (requests, failed before their
/// first token, failed after it, messages of the failures).
async fn load(addr: String, width: usize, stop: Arc<AtomicBool>) -> (usize, usize, usize, Vec<String>) {
    let c = client(&addr).await;
    let (mut n, mut before, mut after, mut why) = (0, 0, 0, Vec::new());
    let mut round = 0u32;
    while !stop.load(Ordering::Acquire) {
        let mut set = tokio::task::JoinSet::new();
        for i in 0..width as u32 {
            let mut c = c.clone();
            let prompt = (0..6).map(|k| 3 + (k + i + round) % 400).collect();
            set.spawn(async move {
                let mut tokens = 0;
                match c.generate(request(prompt, 6)).await {
                    Err(e) => (0, Some(e)),
                    Ok(resp) => {
                        let mut s = resp.into_inner();
                        while let Some(m) = tokio_stream::StreamExt::next(&mut s).await {
                            match m {
                                Ok(m) => tokens += m.token_ids.len(),
                                Err(e) => return (tokens, Some(e)),
                            }
                        }
                        (tokens, None)
                    }
                }
            });
        }
        while let Some(r) = set.join_next().await {
            let (tokens, err) = r.unwrap();
            n += 1;
            if let Some(e) = err {
                why.push(format!("{e:?}"));
                if tokens == 0 {
                    before += 1;
                } else {
                    after += 1;
                }
            }
        }
        round += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (n, before, after, why)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_of_a_worker_process_under_load_fails_no_unstarted_request() {
    let dir = tempfile::tempdir().unwrap();
    let mut a = worker(dir.path(), "a", &["--drain-timeout-s", "20"]);
    let b = worker(dir.path(), "b", &[]);
    let r = router(dir.path(), "r", &[&a.addr, &b.addr], &[]);
    assert!(wait_serving(&r.addr, None, Duration::from_secs(30)).await, "{}", r.log());
    // Both groups take work before the stop.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let stop = Arc::new(AtomicBool::new(false));
    let sequential = tokio::spawn(load(r.addr.clone(), 1, stop.clone()));
    let concurrent = tokio::spawn(load(r.addr.clone(), 6, stop.clone()));
    tokio::time::sleep(Duration::from_millis(700)).await;
    a.terminate();
    let status = tokio::task::block_in_place(|| a.wait(Duration::from_secs(30)));
    let status = status.unwrap_or_else(|| panic!("the worker did not stop after SIGTERM:\n{}", a.log()));
    assert!(status.success(), "exit {status:?}:\n{}", a.log());
    let log = a.log();
    assert!(log.contains("draining: no new requests") && log.contains("worker stopped"), "{log}");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    stop.store(true, Ordering::Release);
    let (n1, b1, a1, w1) = sequential.await.unwrap();
    let (n2, b2, a2, w2) = concurrent.await.unwrap();
    assert!(n1 + n2 > 20, "too little load: {n1} + {n2}");
    assert_eq!(b1 + b2, 0, "{} of {} requests failed before streaming: {:?}", b1 + b2, n1 + n2, [w1, w2].concat());
    assert_eq!(a1 + a2, 0, "short requests failed mid-stream: {:?}", [w1, w2].concat());
    // The other group still serves.
    assert!(wait_serving(&r.addr, None, Duration::from_secs(5)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_logs_each_request_with_its_id() {
    let dir = tempfile::tempdir().unwrap();
    let w = worker(dir.path(), "w", &[]);
    let r = router(dir.path(), "r", &[&w.addr], &[]);
    assert!(wait_serving(&r.addr, None, Duration::from_secs(30)).await, "{}", r.log());
    let mut req = request(vec![5, 6, 7], 3);
    req.request_id = "trace-me-4711".into();
    let mut s = client(&r.addr).await.generate(req).await.unwrap().into_inner();
    while tokio_stream::StreamExt::next(&mut s).await.is_some() {}
    let mut found = false;
    for _ in 0..50 {
        found = r.log().lines().any(|l| l.contains("trace-me-4711") && l.contains("request finished"));
        if found {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(found, "{}", r.log());
}

/// The longest pause between the messages of a decoding stream while a max-length
/// prompt is prefilled beside it, on a CPU worker started with `extra` flags.
async fn stall_beside_a_long_prompt(dir: &std::path::Path, name: &str, extra: &[&str]) -> Duration {
    let w = worker(dir, name, extra);
    let r = router(dir, &format!("{name}-router"), &[&w.addr], &[]);
    assert!(wait_serving(&r.addr, None, Duration::from_secs(30)).await, "{}", r.log());
    let mut c = client(&r.addr).await;
    let mut s = c.generate(request(vec![5, 6, 7, 8], 400)).await.unwrap().into_inner();
    let first = tokio_stream::StreamExt::next(&mut s).await.unwrap().unwrap();
    assert!(!first.token_ids.is_empty());
    let stream = tokio::spawn(async move {
        let mut at = vec![std::time::Instant::now()];
        while let Some(m) = tokio_stream::StreamExt::next(&mut s).await {
            m.unwrap();
            at.push(std::time::Instant::now());
        }
        at
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sent = std::time::Instant::now();
    // A prompt of nearly the whole context (1024 positions less the drafter's headroom).
    let long: Vec<u32> = (0..1000).map(|i| 3 + (i * 7) % 4000).collect();
    let mut l = c.generate(request(long, 2)).await.unwrap().into_inner();
    while let Some(m) = tokio_stream::StreamExt::next(&mut l).await {
        m.unwrap();
    }
    let done = std::time::Instant::now();
    let at = stream.await.unwrap();
    let during: Vec<_> = at.windows(2).filter(|w| w[1] > sent && w[0] < done).map(|w| w[1] - w[0]).collect();
    assert!(!during.is_empty(), "the stream must still run during the long prefill");
    during.into_iter().max().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prompt_does_not_stall_the_other_streams() {
    let dir = tempfile::tempdir().unwrap();
    // The whole prompt in one step: the stall the default avoids.
    let uncapped = stall_beside_a_long_prompt(dir.path(), "uncapped", &["--max-prefill-tokens", "2048"]).await;
    let capped = stall_beside_a_long_prompt(dir.path(), "default", &[]).await;
    eprintln!("longest pause: {capped:?} by default, {uncapped:?} with the whole prompt in one step");
    assert!(capped * 3 < uncapped, "default {capped:?} vs uncapped {uncapped:?}");
}

/// A worker serves `/metrics` from the start and publishes its model load there; once
/// loaded, every checkpoint byte is counted and nothing is left.
#[test]
fn the_model_load_is_on_the_workers_metrics() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let metrics = format!("127.0.0.1:{port}");
    let w = worker(dir.path(), "w", &["--metrics-listen", &metrics]);
    let mut body = String::new();
    let mut s = std::net::TcpStream::connect(&metrics).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n").unwrap();
    s.read_to_string(&mut body).unwrap();
    let value = |name: &str| -> f64 {
        body.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
            .unwrap_or_else(|| panic!("no {name} in\n{body}"))
    };
    let done = value("mlaserve_model_load_bytes_done ");
    let expected = value("mlaserve_model_load_bytes_expected ");
    let size: u64 = std::fs::read_dir(common::model())
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .map(|e| e.metadata().unwrap().len())
        .sum();
    assert!(expected > 0.5 * size as f64 && expected <= size as f64, "{expected} of {size} file bytes");
    assert_eq!(done, expected);
    assert_eq!(value("mlaserve_model_load_remaining_seconds "), 0.0);
    assert!(value("mlaserve_model_load_bytes_per_second ") > 0.0);
    assert!(w.log().contains("model loaded"), "{}", w.log());
}
