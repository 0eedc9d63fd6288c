//! `Tokenize` under abuse: texts too long to ever fit the served context are refused
//! before the tokenizer runs (it takes about 200 times a text's size), so a flood of
//! 3.9 MB texts leaves memory where it was; calls are admitted like generations.

#![allow(clippy::unwrap_used)]

mod common;

use common::*;
use mlaserve_proto::v1::TokenizeRequest;
use tokio_stream::StreamExt;
use tonic::Code;

/// This process's resident set in MiB (router and group run in it).
fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    kb / 1024.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_huge_texts_is_refused_and_memory_stays_put() {
    let s = serve(|_| {});
    let c = client(s.get().addr()).await;
    let small = c.clone().tokenize(TokenizeRequest { text: "def f(x):".into(), add_special_tokens: true }).await;
    assert!(!small.unwrap().into_inner().token_ids.is_empty());
    let before = rss_mib();
    let huge: String = (0..3_900_000u64).map(|i| (b'a' + (i * 7919 % 26) as u8) as char).collect();
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let (mut c, text) = (c.clone(), huge.clone());
        calls.spawn(async move { c.tokenize(TokenizeRequest { text, add_special_tokens: false }).await });
    }
    while let Some(r) = calls.join_next().await {
        let e = r.unwrap().expect_err("a 3.9 MB text is refused");
        assert_eq!(e.code(), Code::InvalidArgument, "{}", e.message());
        assert!(e.message().starts_with("text:") && e.message().contains("limit"), "{}", e.message());
    }
    let grown = rss_mib() - before;
    assert!(grown < 150.0, "RSS grew by {grown:.0} MiB");
    let again = c.clone().tokenize(TokenizeRequest { text: "x = 1".into(), add_special_tokens: false }).await;
    assert!(again.is_ok(), "the server still serves: {again:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_is_admitted_like_a_generation() {
    let s = serve(|a| a.queue_size = 1);
    let mut c = client(s.get().addr()).await;
    // One long generation holds the only admission slot.
    let mut held = c.generate(ids_request(vec![2, 3, 4], 200)).await.unwrap().into_inner();
    assert!(held.next().await.unwrap().is_ok());
    let e = c.tokenize(TokenizeRequest { text: "x".into(), add_special_tokens: false }).await.expect_err("full");
    assert_eq!(e.code(), Code::ResourceExhausted, "{}", e.message());
    drop(held);
    let ok = async {
        loop {
            match c.tokenize(TokenizeRequest { text: "x".into(), add_special_tokens: false }).await {
                Ok(r) => return r.into_inner(),
                Err(_) => tokio::time::sleep(std::time::Duration::from_millis(20)).await,
            }
        }
    };
    let r = tokio::time::timeout(std::time::Duration::from_secs(5), ok).await.expect("the slot comes back");
    assert!(!r.token_ids.is_empty());
}
