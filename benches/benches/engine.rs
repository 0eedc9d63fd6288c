//! `cd benches && cargo bench --bench engine [-- running=256 k=3 mtp=1 vocab=16 sampled steps=500]`:
//! host-side scheduling and bookkeeping time per step with many running requests
//! (goal: median <= 50 us with 256). With no arguments it runs the standard cases.

use mlaserve_engine::{bench_engine, BenchConfig};

fn parse(args: &[String]) -> Option<BenchConfig> {
    let mut c = BenchConfig::default();
    let mut any = false;
    for a in args {
        let (k, v) = a.split_once('=').unwrap_or((a.as_str(), ""));
        let n = v.parse::<usize>().ok();
        match (k, n) {
            ("running", Some(n)) => c.running = n,
            ("k", Some(n)) => c.k = n,
            ("vocab", Some(n)) => c.vocab = n,
            ("steps", Some(n)) => c.steps = n,
            ("prompt", Some(n)) => c.prompt_len = n,
            ("sampled", _) => c.sampled = true,
            ("mtp", Some(n)) => c.mtp_layers = Some(n),
            _ => continue,
        }
        any = true;
    }
    any.then_some(c)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let base = BenchConfig::default();
    let cases = match parse(&args) {
        Some(c) => vec![c],
        None => vec![
            base.clone(),
            BenchConfig { mtp_layers: Some(1), ..base.clone() },
            BenchConfig { k: 0, ..base.clone() },
            BenchConfig { sampled: true, ..base.clone() },
            BenchConfig { vocab: 512, ..base.clone() },
        ],
    };
    for c in cases {
        match bench_engine(&c) {
            Ok(r) => println!("{r}"),
            Err(e) => {
                eprintln!("bench failed: {e}");
                std::process::exit(1);
            }
        }
    }
}
