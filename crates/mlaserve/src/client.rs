//! Client side of the public API: `mlaserve generate` (stream one completion to the
//! terminal) and `mlaserve bench serve` (many concurrent streams; TTFT, inter-token
//! latency, end-to-end latency and throughput percentiles). The load test drives it too.

use mlaserve_proto::v1::{
    generate_request::Prompt, generation_client::GenerationClient, FinishReason, GenerateRequest, SamplingParams,
    StoppingCriteria,
};
use std::io::Write;
use std::time::{Duration, Instant};
use tokio_stream::StreamExt;
use tonic::transport::{Channel, Endpoint};

/// Settings of `mlaserve generate`.
#[derive(Debug, Clone, clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompt", "prompt_ids"])))]
pub struct GenerateArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// The prompt text (the router tokenizes it).
    #[arg(long)]
    pub prompt: Option<String>,
    /// The prompt as token ids, comma separated (instead of --prompt).
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// New tokens at most; default: the server's (256, clipped to the context left).
    #[arg(long)]
    pub max_new_tokens: Option<u32>,
    /// Sampling temperature; 0 (the default) is greedy.
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Nucleus sampling: keep the smallest set of tokens whose probability reaches this.
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Keep only the k most likely tokens (0: no cut).
    #[arg(long)]
    pub top_k: Option<i32>,
    /// Seed of the request's sampling (the same seed gives the same tokens).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop string (repeatable); the text ends before it.
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating past the model's end-of-sequence tokens (up to --max-new-tokens).
    #[arg(long)]
    pub ignore_eos: bool,
}

/// Errors of the client commands.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to {0}: {1}")]
    Connect(String, String),
    /// The server's status: its code (as gRPC names it) and message.
    #[error("{:?}: {}", .0.code(), .0.message())]
    Status(#[from] tonic::Status),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Protocol(String),
}

/// Where the router is and how to reach it (the client commands share these flags).
#[derive(Debug, Clone, clap::Args)]
pub struct ServerArgs {
    /// Router address (`host:port`, `http://host:port`, or `https://host:port` for TLS).
    #[arg(long, default_value = "http://127.0.0.1:50051")]
    pub addr: String,
    /// API key sent as `authorization: Bearer <key>` (also read from MLASERVE_API_KEY).
    #[arg(long, env = "MLASERVE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// PEM CA certificate to verify the router's TLS certificate with (implies https).
    #[arg(long)]
    pub tls_ca: Option<std::path::PathBuf>,
}

impl ServerArgs {
    pub fn new(addr: impl Into<String>) -> Self {
        ServerArgs { addr: addr.into(), api_key: None, tls_ca: None }
    }

    /// `msg` as a request carrying the API key, if any.
    pub fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        if let Some(v) = self.api_key.as_ref().and_then(|k| format!("Bearer {k}").parse().ok()) {
            r.metadata_mut().insert("authorization", v);
        }
        r
    }
}

/// Connects a client to the router `server` names.
pub async fn connect(server: &ServerArgs) -> Result<GenerationClient<Channel>, ClientError> {
    let mut url = mlaserve_cluster::keys::normalize_addr(&server.addr);
    if let (Some(_), Some(rest)) = (&server.tls_ca, url.strip_prefix("http://")) {
        url = format!("https://{rest}");
    }
    let fail = |e: &dyn std::fmt::Display| ClientError::Connect(url.clone(), e.to_string());
    let mut ep = Endpoint::from_shared(url.clone()).map_err(|e| fail(&e))?.tcp_nodelay(true);
    if let Some(ca) = &server.tls_ca {
        let pem = std::fs::read(ca)
            .map_err(|e| ClientError::Connect(url.clone(), format!("--tls-ca {}: {e}", ca.display())))?;
        let tls = tonic::transport::ClientTlsConfig::new().ca_certificate(tonic::transport::Certificate::from_pem(pem));
        ep = ep.tls_config(tls).map_err(|e| fail(&e))?;
    } else if url.starts_with("https://") {
        ep = ep.tls_config(tonic::transport::ClientTlsConfig::new().with_native_roots()).map_err(|e| fail(&e))?;
    }
    let ch = ep.connect().await.map_err(|e| fail(&e))?;
    Ok(GenerationClient::new(ch).max_decoding_message_size(64 << 20))
}

/// `mlaserve generate`: streams the completion to stdout, then a usage line.
pub async fn generate(args: GenerateArgs) -> Result<(), ClientError> {
    let mut client = connect(&args.server).await?;
    let prompt = match (&args.prompt, &args.prompt_ids) {
        (Some(t), _) => Prompt::Text(t.clone()),
        (None, Some(ids)) => Prompt::TokenIds(mlaserve_proto::v1::TokenIds { ids: ids.clone() }),
        (None, None) => return Err(ClientError::Protocol("give --prompt or --prompt-ids".into())),
    };
    let req = GenerateRequest {
        prompt: Some(prompt),
        sampling: Some(SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed,
            ..Default::default()
        }),
        stopping: Some(StoppingCriteria {
            max_new_tokens: args.max_new_tokens,
            stop: args.stop.clone(),
            ignore_eos: args.ignore_eos,
            ..Default::default()
        }),
        ..Default::default()
    };
    let start = Instant::now();
    let mut stream = client.generate(args.server.request(req)).await?.into_inner();
    let mut out = std::io::stdout();
    if let Some(t) = &args.prompt {
        write!(out, "{t}")?;
    }
    while let Some(msg) = stream.next().await {
        let msg = msg?;
        write!(out, "{}", msg.text)?;
        out.flush()?;
        if let Some(f) = msg.finish {
            let u = f.usage.unwrap_or_default();
            let secs = start.elapsed().as_secs_f64();
            let reason = FinishReason::try_from(f.reason).map(|r| r.as_str_name()).unwrap_or("?");
            writeln!(out)?;
            eprintln!(
                "[{} prompt + {} generated tokens in {:.2} s: {:.1} tokens/s, TTFT {:.0} ms, mean acceptance length {:.2}, {}]",
                u.prompt_tokens,
                u.completion_tokens,
                secs,
                u.completion_tokens as f64 / secs.max(1e-9),
                u.time_to_first_token_s * 1000.0,
                u.mean_acceptance_length,
                reason.trim_start_matches("FINISH_REASON_").to_lowercase(),
            );
            return Ok(());
        }
    }
    Err(ClientError::Protocol("the stream ended without a final message".into()))
}

/// Settings of `mlaserve bench serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub server: ServerArgs,
    /// Streams in flight at once (closed loop). Ignored when --rate is set.
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// Requests per second, open loop (Poisson arrivals); unset: closed loop.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Requests in all.
    #[arg(long, default_value_t = 256)]
    pub requests: usize,
    /// Prompt length in tokens (random ids from a fixed seed).
    #[arg(long, default_value_t = 32)]
    pub prompt_tokens: usize,
    /// New tokens per request (ignore_eos, so every request generates exactly this many).
    #[arg(long, default_value_t = 32)]
    pub max_new_tokens: u32,
    /// HTTP/2 connections to spread the streams over.
    #[arg(long, default_value_t = 8)]
    pub connections: usize,
    /// Stop after this many seconds whatever is left (every open stream is cancelled).
    #[arg(long, default_value_t = 600)]
    pub time_limit_s: u64,
    /// Vocabulary ids are drawn below this bound.
    #[arg(long, default_value_t = 256)]
    pub vocab: u32,
    /// `random`: every prompt its own random ids. `shared-prefix`: conversations of
    /// --turns turns, each opening with one of --system-prompts system prompts; a turn's
    /// prompt is the conversation so far (system prompt, earlier user messages and
    /// replies) and a new user message of --prompt-tokens ids. Closed loop: --concurrency
    /// conversations at once, --requests turns in all.
    #[arg(long, value_enum, default_value_t = Workload::Random)]
    pub workload: Workload,
    /// shared-prefix: distinct system prompts.
    #[arg(long, default_value_t = 8)]
    pub system_prompts: usize,
    /// shared-prefix: system prompt lengths are drawn from MIN..=MAX tokens.
    #[arg(long, value_parser = parse_range, default_value = "1024..=2048")]
    pub system_prompt_tokens: (usize, usize),
    /// shared-prefix: turns per conversation.
    #[arg(long, default_value_t = 4)]
    pub turns: usize,
    /// shared-prefix: a user's think time between a reply and the next turn, mean in ms
    /// (exponential draws from a fixed seed; 0: the next turn at once). The conversation's
    /// stream is idle meanwhile, as a chat user's is.
    #[arg(long, default_value_t = 0)]
    pub think_time_ms: u64,
    /// `grpc`: `mlaserve.v1` at --addr; `openai`: streaming `POST /v1/completions` at
    /// --addr, the HTTP API (`http://host:port`; one connection per request).
    #[arg(long, value_enum, default_value_t = Api::Grpc)]
    pub api: Api,
    /// Prompts from a JSONL file instead of random ids: one `{"prompt_ids": [ids]}` per
    /// line (as `models/*/eval_prompts.jsonl`); request i sends line i mod their number
    /// (--prompt-tokens and --vocab then do not apply). The random workload only.
    #[arg(long)]
    pub prompts: Option<std::path::PathBuf>,
}

/// `bench serve --api`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Api {
    Grpc,
    Openai,
}

/// `bench serve --workload`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    Random,
    SharedPrefix,
}

/// `MIN..=MAX` (or a single number).
fn parse_range(s: &str) -> Result<(usize, usize), String> {
    let num = |x: &str| x.trim().parse::<usize>().map_err(|e| format!("{x:?}: {e}"));
    let (lo, hi) = match s.split_once("..=") {
        Some((a, b)) => (num(a)?, num(b)?),
        None => (num(s)?, num(s)?),
    };
    if lo > hi {
        return Err(format!("{lo} > {hi}"));
    }
    Ok((lo, hi))
}

impl BenchArgs {
    pub fn new(addr: impl Into<String>) -> Self {
        BenchArgs {
            server: ServerArgs::new(addr),
            concurrency: 32,
            rate: None,
            requests: 256,
            prompt_tokens: 32,
            max_new_tokens: 32,
            connections: 8,
            time_limit_s: 600,
            vocab: 256,
            workload: Workload::Random,
            system_prompts: 8,
            system_prompt_tokens: (1024, 2048),
            turns: 4,
            think_time_ms: 0,
            api: Api::Grpc,
            prompts: None,
        }
    }
}

/// The prompts of a `--prompts` file: one JSON object per non-empty line, its
/// `prompt_ids` an array of token ids. Errors name the file and the line.
pub fn load_prompts(path: &std::path::Path) -> Result<Vec<Vec<u32>>, ClientError> {
    let at = |n: usize, why: &str| ClientError::Protocol(format!("--prompts {}: line {n}: {why}", path.display()));
    let text = std::fs::read_to_string(path)
        .map_err(|e| ClientError::Protocol(format!("--prompts {}: {e}", path.display())))?;
    let mut prompts = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| at(i + 1, &e.to_string()))?;
        let ids = v["prompt_ids"].as_array().ok_or_else(|| at(i + 1, "no \"prompt_ids\" array"))?;
        let ids = ids
            .iter()
            .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| at(i + 1, "\"prompt_ids\" holds something other than token ids"))?;
        if ids.is_empty() {
            return Err(at(i + 1, "an empty prompt"));
        }
        prompts.push(ids);
    }
    if prompts.is_empty() {
        return Err(ClientError::Protocol(format!("--prompts {}: no prompts", path.display())));
    }
    Ok(prompts)
}

/// One request's outcome as the client saw it.
#[derive(Debug, Clone, Default)]
pub struct Sample {
    pub ttft: Option<Duration>,
    pub itl: Vec<Duration>,
    pub e2e: Duration,
    pub tokens: u32,
    /// Final messages seen (must be exactly 1 for a successful request).
    pub finals: u32,
    pub error: Option<tonic::Code>,
    /// The generated ids.
    pub output: Vec<u32>,
    /// From the final message's usage: the prompt's tokens, and those the group found
    /// in its prefix cache.
    pub prompt_tokens: u32,
    pub cached_prompt_tokens: u32,
}

/// Percentiles of one quantity, in milliseconds.
#[derive(Debug, Clone, Copy, Default)]
pub struct Pcts {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Pcts {
    pub fn of(mut v: Vec<Duration>) -> Pcts {
        if v.is_empty() {
            return Pcts::default();
        }
        v.sort_unstable();
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1000.0;
        Pcts { p50: at(0.5), p90: at(0.9), p99: at(0.99), max: at(1.0) }
    }
}

/// What `bench serve` measured.
#[derive(Debug, Clone, Default)]
pub struct BenchReport {
    pub requests: usize,
    pub ok: usize,
    pub errors: Vec<(tonic::Code, usize)>,
    pub ttft: Pcts,
    pub itl: Pcts,
    pub e2e: Pcts,
    pub wall: Duration,
    pub tokens: u64,
    /// Prompt tokens of the successful requests, and of those the prefix caches held.
    pub prompt_tokens: u64,
    pub cached_prompt_tokens: u64,
    pub samples: Vec<Sample>,
}

impl BenchReport {
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.wall.as_secs_f64().max(1e-9)
    }

    /// Fraction of prompt tokens found in the groups' prefix caches.
    pub fn cached_ratio(&self) -> f64 {
        self.cached_prompt_tokens as f64 / (self.prompt_tokens as f64).max(1.0)
    }
}

impl std::fmt::Display for BenchReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "requests {} ok {} errors {:?} wall {:.2} s",
            self.requests,
            self.ok,
            self.errors,
            self.wall.as_secs_f64()
        )?;
        writeln!(
            f,
            "throughput {:.1} generated tokens/s, {:.2} requests/s",
            self.tokens_per_s(),
            self.ok as f64 / self.wall.as_secs_f64().max(1e-9)
        )?;
        writeln!(
            f,
            "prompt tokens {}, {:.1}% of them in the prefix cache",
            self.prompt_tokens,
            100.0 * self.cached_ratio()
        )?;
        for (name, p) in [("TTFT", self.ttft), ("inter-token", self.itl), ("end-to-end", self.e2e)] {
            writeln!(f, "{name:>12} ms: p50 {:.1}  p90 {:.1}  p99 {:.1}  max {:.1}", p.p50, p.p90, p.p99, p.max)?;
        }
        Ok(())
    }
}

/// Deterministic prompt ids for request `i`.
pub fn bench_prompt(i: usize, len: usize, vocab: u32) -> Vec<u32> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (i as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // Keep clear of the low ids (BOS/EOS and other specials of small vocabularies).
            2 + (x % (vocab.max(3) as u64 - 2)) as u32
        })
        .collect()
}

/// Runs one streaming request and times it.
pub async fn timed_request(
    client: &mut GenerationClient<Channel>,
    req: impl tonic::IntoRequest<GenerateRequest>,
) -> Sample {
    let start = Instant::now();
    let mut s = Sample::default();
    let mut last: Option<Instant> = None;
    match client.generate(req).await {
        Err(e) => s.error = Some(e.code()),
        Ok(resp) => {
            let mut stream = resp.into_inner();
            while let Some(msg) = stream.next().await {
                match msg {
                    Err(e) => {
                        s.error = Some(e.code());
                        break;
                    }
                    Ok(m) => {
                        if !m.token_ids.is_empty() {
                            let now = Instant::now();
                            match last {
                                None => s.ttft = Some(now - start),
                                Some(l) => s.itl.push(now - l),
                            }
                            last = Some(now);
                            s.tokens += m.token_ids.len() as u32;
                            s.output.extend_from_slice(&m.token_ids);
                        }
                        if let Some(f) = &m.finish {
                            s.finals += 1;
                            if let Some(u) = &f.usage {
                                (s.prompt_tokens, s.cached_prompt_tokens) = (u.prompt_tokens, u.cached_prompt_tokens);
                            }
                        }
                    }
                }
            }
        }
    }
    s.e2e = start.elapsed();
    s
}

/// `mlaserve bench serve`.
pub async fn bench(args: &BenchArgs) -> Result<BenchReport, ClientError> {
    let http = match args.api {
        Api::Grpc => None,
        Api::Openai => Some(crate::http_bench::authority(&args.server.addr).map_err(ClientError::Protocol)?),
    };
    if args.workload == Workload::SharedPrefix {
        if args.prompts.is_some() {
            return Err(ClientError::Protocol("--prompts applies to the random workload only".into()));
        }
        if http.is_some() {
            return Err(ClientError::Protocol(
                "--workload shared-prefix runs over gRPC only (its turns extend the token ids of the replies)".into(),
            ));
        }
        return crate::workload::conversations(args).await;
    }
    let prompts = args.prompts.as_deref().map(load_prompts).transpose()?;
    let mut clients = Vec::new();
    if http.is_none() {
        for _ in 0..args.connections.max(1) {
            clients.push(connect(&args.server).await?);
        }
    }
    let start = Instant::now();
    let deadline = start + Duration::from_secs(args.time_limit_s);
    let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(if args.rate.is_some() {
        tokio::sync::Semaphore::MAX_PERMITS
    } else {
        args.concurrency.max(1)
    }));
    let mut tasks = tokio::task::JoinSet::new();
    // A progress line on stderr every few seconds: a long run is not silent.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let progress = {
        let (done, total) = (done.clone(), args.requests);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(PROGRESS_PERIOD);
            tick.tick().await;
            loop {
                tick.tick().await;
                let n = done.load(std::sync::atomic::Ordering::Relaxed);
                eprintln!("bench serve: {n}/{total} requests done after {:.0} s", start.elapsed().as_secs_f64());
            }
        })
    };
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next_at = Instant::now();
    for i in 0..args.requests {
        if let Some(rate) = args.rate {
            // Exponential inter-arrival times: a Poisson process of `rate` per second.
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let u = ((rng >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            next_at += Duration::from_secs_f64(-u.ln() / rate.max(1e-9));
            tokio::time::sleep_until(next_at.into()).await;
        }
        let Ok(permit) = sem.clone().acquire_owned().await else { break };
        if Instant::now() >= deadline {
            break;
        }
        let ids = match &prompts {
            Some(d) => d[i % d.len()].clone(),
            None => bench_prompt(i, args.prompt_tokens, args.vocab),
        };
        if let Some(authority) = http.clone() {
            let (done, key, max) = (done.clone(), args.server.api_key.clone(), args.max_new_tokens);
            tasks.spawn(async move {
                let timed = crate::http_bench::timed_completion(&authority, key.as_deref(), &ids, max);
                let s = tokio::time::timeout_at(deadline.into(), timed).await;
                drop(permit);
                done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                s.unwrap_or(Sample { error: Some(tonic::Code::DeadlineExceeded), ..Default::default() })
            });
            continue;
        }
        let mut client = clients[i % clients.len()].clone();
        let req = GenerateRequest {
            prompt: Some(Prompt::TokenIds(mlaserve_proto::v1::TokenIds { ids })),
            stopping: Some(StoppingCriteria {
                max_new_tokens: Some(args.max_new_tokens),
                ignore_eos: true,
                ..Default::default()
            }),
            ..Default::default()
        };
        let done = done.clone();
        let req = args.server.request(req);
        tasks.spawn(async move {
            let s = tokio::time::timeout_at(deadline.into(), timed_request(&mut client, req)).await;
            drop(permit);
            done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            s.unwrap_or(Sample { error: Some(tonic::Code::DeadlineExceeded), ..Default::default() })
        });
    }
    let mut samples = Vec::with_capacity(args.requests);
    while let Some(r) = tasks.join_next().await {
        if let Ok(s) = r {
            samples.push(s);
        }
    }
    progress.abort();
    Ok(report(samples, start.elapsed()))
}

/// How often `bench serve` reports its progress.
const PROGRESS_PERIOD: Duration = Duration::from_secs(5);

/// Summarises samples.
pub fn report(samples: Vec<Sample>, wall: Duration) -> BenchReport {
    let mut errors: Vec<(tonic::Code, usize)> = Vec::new();
    for s in &samples {
        if let Some(c) = s.error {
            match errors.iter_mut().find(|(k, _)| *k == c) {
                Some((_, n)) => *n += 1,
                None => errors.push((c, 1)),
            }
        }
    }
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.error.is_none()).collect();
    BenchReport {
        requests: samples.len(),
        ok: ok.len(),
        errors,
        ttft: Pcts::of(ok.iter().filter_map(|s| s.ttft).collect()),
        itl: Pcts::of(ok.iter().flat_map(|s| s.itl.iter().copied()).collect()),
        e2e: Pcts::of(ok.iter().map(|s| s.e2e).collect()),
        wall,
        tokens: ok.iter().map(|s| s.tokens as u64).sum(),
        prompt_tokens: ok.iter().map(|s| s.prompt_tokens as u64).sum(),
        cached_prompt_tokens: ok.iter().map(|s| s.cached_prompt_tokens as u64).sum(),
        samples,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(text.as_bytes()).unwrap();
        f
    }

    #[test]
    fn a_prompts_file_reads_its_prompts_and_names_a_bad_line() {
        let f = file("{\"prompt_ids\": [0, 4, 2540]}\n\n{\"prompt_ids\": [7], \"other\": 1}\n");
        assert_eq!(load_prompts(f.path()).unwrap(), vec![vec![0, 4, 2540], vec![7]]);
        let bundled =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/mla-tiny-code/eval_prompts.jsonl");
        assert_eq!(load_prompts(&bundled).unwrap().len(), 50);
        for (text, why) in [
            ("{\"prompt_ids\": [1]}\n{\"prompt\": \"x\"}\n", "line 2: no \"prompt_ids\" array"),
            ("{\"prompt_ids\": [1, -2]}\n", "line 1: \"prompt_ids\" holds something other than token ids"),
            ("{\"prompt_ids\": []}\n", "line 1: an empty prompt"),
            ("not json\n", "line 1: "),
            ("\n", "no prompts"),
        ] {
            let f = file(text);
            let e = load_prompts(f.path()).unwrap_err().to_string();
            assert!(e.contains(why) && e.contains(&f.path().display().to_string()), "{text:?}: {e}");
        }
    }
}
