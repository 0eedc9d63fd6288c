//! `mlaserve bench load`: how fast a checkpoint loads onto a GPU, beside how fast the
//! same files read from the disk and from the page cache, measured in the same run.
//!
//! The reads use the loader's thread count and whole-file sequential reads: the disk rate
//! after the files are evicted from the page cache (`posix_fadvise(DONTNEED)`, which
//! needs no privileges for clean pages), the page-cache rate on a second read of cached
//! files. The load is `CudaBackend::load` (one GPU, the whole checkpoint), timed from the
//! call to the weights being on the device, cold (files evicted first) and warm.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The checkpoint directory (safetensors files, optionally with an index).
    #[arg(long)]
    model: PathBuf,
    /// CUDA device.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Also measure cold: evict the files from the page cache, then read them (the disk's
    /// rate), evict again, then load.
    #[arg(long)]
    cold: bool,
    /// Threads reading the files for the disk and page-cache rates.
    #[arg(long, default_value_t = 8)]
    threads: usize,
}

/// The checkpoint's safetensors files (as the loader finds them).
fn files(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let w = mlaserve_model::Weights::open_unchecked(dir, None).with_context(|| format!("--model {}", dir.display()))?;
    Ok(w.files().into_iter().map(Path::to_path_buf).collect())
}

/// Drops the files' clean pages from the page cache.
fn evict(files: &[PathBuf]) -> anyhow::Result<()> {
    use std::os::fd::AsRawFd;
    for f in files {
        let file = std::fs::File::open(f).with_context(|| format!("opening {}", f.display()))?;
        // SAFETY: a valid open descriptor; POSIX_FADV_DONTNEED only drops cached pages.
        let rc = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        anyhow::ensure!(rc == 0, "posix_fadvise on {}: error {rc}", f.display());
    }
    Ok(())
}

/// Reads every file whole on `threads` threads (files and 64 MiB ranges handed out in
/// order); returns (bytes, seconds).
fn read_all(files: &[PathBuf], threads: usize) -> anyhow::Result<(u64, f64)> {
    const PIECE: u64 = 64 << 20;
    let mut pieces = Vec::new();
    for f in files {
        let len = std::fs::metadata(f).with_context(|| format!("stat {}", f.display()))?.len();
        let mut at = 0;
        while at < len {
            pieces.push((f.clone(), at, PIECE.min(len - at)));
            at += PIECE;
        }
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let t0 = Instant::now();
    let total = std::thread::scope(|s| -> anyhow::Result<u64> {
        let handles: Vec<_> = (0..threads.max(1))
            .map(|_| {
                s.spawn(|| -> anyhow::Result<u64> {
                    use std::io::Seek;
                    let mut buf = vec![0u8; PIECE as usize];
                    let mut done = 0u64;
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some((f, at, len)) = pieces.get(i) else { return Ok(done) };
                        let mut file = std::fs::File::open(f)?;
                        file.seek(std::io::SeekFrom::Start(*at))?;
                        file.read_exact(&mut buf[..*len as usize])?;
                        done += len;
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().map_err(|_| anyhow::anyhow!("reader panicked"))?).sum()
    })?;
    Ok((total, t0.elapsed().as_secs_f64()))
}

#[cfg(feature = "cuda")]
fn load_once(dir: &Path, device: usize) -> anyhow::Result<(u64, f64)> {
    let t0 = Instant::now();
    let be = mlaserve_cuda::CudaBackend::load_with(dir, mlaserve_cuda::CudaOptions::new(16, device))
        .with_context(|| format!("loading {}", dir.display()))?;
    be.gpu().sync()?;
    let secs = t0.elapsed().as_secs_f64();
    let bytes = mlaserve_model::Weights::open_unchecked(dir, None)?.data_bytes();
    Ok((bytes, secs))
}

#[cfg(not(feature = "cuda"))]
fn load_once(_: &Path, _: usize) -> anyhow::Result<(u64, f64)> {
    anyhow::bail!("`bench load` needs a build with --features cuda")
}

/// Seconds a load takes whatever the checkpoint's size (the CUDA context, the kernels'
/// modules, the backend's buffers): the warm load of the tiny fp8 preset, best of three.
fn fixed_seconds(device: usize) -> anyhow::Result<f64> {
    let t = std::env::temp_dir().join(format!("mlaserve-bench-load-{}", std::process::id()));
    let gen = mlaserve_model::presets::GenOptions { fp8: true, ..Default::default() };
    mlaserve_model::presets::generate_opts("tiny-v3", &t, &gen)?;
    let best = (0..3).map(|_| load_once(&t, device).map(|r| r.1)).collect::<anyhow::Result<Vec<f64>>>();
    let _ = std::fs::remove_dir_all(&t);
    Ok(best?.into_iter().fold(f64::INFINITY, f64::min))
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let files = files(&a.model)?;
    let gbps = |(b, s): (u64, f64)| b as f64 / s / 1e9;
    let mut rows: Vec<(String, (u64, f64))> = Vec::new();
    if a.cold {
        evict(&files)?;
        rows.push(("disk read (evicted, {t} threads)".into(), read_all(&files, a.threads)?));
        evict(&files)?;
        rows.push(("load onto the GPU, cold".into(), load_once(&a.model, a.device)?));
    }
    read_all(&files, a.threads)?;
    let cached = read_all(&files, a.threads)?;
    rows.push(("page-cache read ({t} threads)".into(), cached));
    let warm = load_once(&a.model, a.device)?;
    rows.push(("load onto the GPU, warm".into(), warm));
    let fixed = fixed_seconds(a.device)?;
    let weights = (warm.0, (warm.1 - fixed).max(1e-9));
    rows.push(("  of which the weights (less fixed)".into(), weights));
    println!("bench load: {} ({} files)", a.model.display(), files.len());
    for (what, r) in &rows {
        let what = what.replace("{t}", &a.threads.to_string());
        println!("{what:<36} {:>8.2} GB in {:>7.2} s = {:>6.2} GB/s", r.0 as f64 / 1e9, r.1, gbps(*r));
    }
    println!(
        "fixed cost of a load (CUDA context, kernel modules; the tiny preset's warm load): {fixed:.2} s\n\
         warm load: {:.2}x the page-cache read time per byte ({:.2}x for the weights alone)",
        gbps(cached) / gbps(warm),
        gbps(cached) / gbps(weights)
    );
    Ok(())
}
