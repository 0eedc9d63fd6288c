//! The tensor-parallel all-reduce as a decode step runs it: inside a CUDA graph, behind
//! other kernels ([`bench_all_reduce`]). Each rank (a thread of this process, one GPU
//! each) captures [`CALLS`] in-place all-reduces of one size into a graph and times its
//! replays with events; the figure is the median replay over the calls. Side by side, in
//! the same run: the one-shot kernels over peer memory (the lines kernel, the flag
//! barrier), NCCL's all-reduce, and a copy kernel of the same size on one GPU (what any
//! kernel node of that size costs in a graph), so the collective's own latency is the
//! difference.

use std::fmt;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use cudarc::driver::CudaSlice;

use crate::bench::time_graph_with;
use crate::util::Util;
use mlaserve_cuda::{CudaError, DeviceComm, Gpu, Result, TpInit};

/// All-reduces captured in one graph.
pub const CALLS: usize = 64;

/// One message size of [`bench_all_reduce`]: microseconds per call (median replay / calls);
/// `None` where the kernel does not take the size.
#[derive(Debug, Clone)]
pub struct CommBenchRow {
    pub floats: usize,
    pub copy_us: f64,
    pub lines_us: Option<f64>,
    pub flags_us: Option<f64>,
    pub nccl_us: f64,
}

/// [`bench_all_reduce`]'s result; `Display` prints the table.
#[derive(Debug, Clone)]
pub struct CommBenchReport {
    pub device: String,
    pub world: usize,
    pub rows: Vec<CommBenchRow>,
}

fn cell(v: Option<f64>) -> String {
    v.map_or("-".into(), |v| format!("{v:.2}"))
}

impl fmt::Display for CommBenchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "all-reduce in a CUDA graph, {} ranks on {} ({CALLS} calls a graph, µs per call, median replay):",
            self.world, self.device
        )?;
        writeln!(
            f,
            "{:>9} {:>10} {:>8} {:>8} {:>8} {:>8} {:>12}",
            "floats", "KiB", "copy", "lines", "flags", "nccl", "best/nccl"
        )?;
        for r in &self.rows {
            let best = [r.lines_us, r.flags_us].into_iter().flatten().fold(f64::INFINITY, f64::min);
            writeln!(
                f,
                "{:>9} {:>10.1} {:>8.2} {:>8} {:>8} {:>8.2} {:>12.3}",
                r.floats,
                r.floats as f64 * 4.0 / 1024.0,
                r.copy_us,
                cell(r.lines_us),
                cell(r.flags_us),
                r.nccl_us,
                best / r.nccl_us
            )?;
        }
        Ok(())
    }
}

/// Which path one timed graph takes.
#[derive(Debug, Clone, Copy)]
enum Path {
    Copy,
    Lines,
    Flags,
    Nccl,
}

/// Times each of `sizes` (floats) on `world` GPUs from `ordinal`, `iters` replays each,
/// the lines kernel up to `lines_bytes`. Every rank runs the same sequence; rank 0's
/// times are the report's.
pub fn bench_all_reduce(
    ordinal: usize,
    world: usize,
    sizes: &[usize],
    lines_bytes: usize,
    iters: usize,
) -> Result<CommBenchReport> {
    if world < 2 {
        return Err(CudaError::shape("bench all-reduce", "needs at least two ranks".to_string()));
    }
    let id = TpInit::new_id()?;
    let max = sizes.iter().copied().max().unwrap_or(1);
    let barrier = Arc::new(Barrier::new(world));
    let results: Vec<Result<(String, Vec<CommBenchRow>)>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..world)
            .map(|rank| {
                let (id, barrier) = (id.clone(), barrier.clone());
                let init = TpInit { rank, world, id, timeout: Duration::from_secs(60) };
                sc.spawn(move || rank_sweep(ordinal + rank, init, (max, lines_bytes), sizes, iters, &barrier))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(CudaError::Collective("a rank panicked".into()))))
            .collect()
    });
    let (device, rows) = results.into_iter().collect::<Result<Vec<_>>>()?.swap_remove(0);
    Ok(CommBenchReport { device, world, rows })
}

fn rank_sweep(
    ordinal: usize,
    init: TpInit,
    (max, lines_bytes): (usize, usize),
    sizes: &[usize],
    iters: usize,
    barrier: &Barrier,
) -> Result<(String, Vec<CommBenchRow>)> {
    let gpu = Gpu::new(ordinal)?;
    let s = gpu.stream.clone();
    let util = Util::new(&gpu)?;
    let mut comm = DeviceComm::new(&s, &init)?;
    let peer = comm.enable_peer_reduce(&gpu, max * 4, lines_bytes)?;
    let lines_max = comm.peer_lines_max().unwrap_or(0);
    let mut rows = Vec::new();
    for &n in sizes {
        let mut buf = s.alloc_zeros::<f32>(n)?;
        util.fill_f32(&s, &mut buf, 11 + init.rank as u64, -1.0, 1.0)?;
        let mut src = s.alloc_zeros::<f32>(n)?;
        util.fill_f32(&s, &mut src, 13, -1.0, 1.0)?;
        let mut time = |path: Path| -> Result<f64> {
            comm.set_peer_lines_max(if matches!(path, Path::Flags) { 0 } else { lines_max });
            time_graph(&gpu, &comm, &util, path, &src, &mut buf, iters, barrier)
        };
        let copy_us = time(Path::Copy)?;
        let lines_us = if n <= lines_max { Some(time(Path::Lines)?) } else { None };
        let flags_us = if peer { Some(time(Path::Flags)?) } else { None };
        let nccl_us = time(Path::Nccl)?;
        rows.push(CommBenchRow { floats: n, copy_us, lines_us, flags_us, nccl_us });
    }
    Ok((gpu.name.clone(), rows))
}

/// Median µs per call of a graph of [`CALLS`] calls of `path` on `buf`, `iters` replays
/// after three untimed ones, each replay started on every rank together (a barrier).
#[allow(clippy::too_many_arguments)]
fn time_graph(
    gpu: &Gpu,
    comm: &DeviceComm,
    util: &Util,
    path: Path,
    src: &CudaSlice<f32>,
    buf: &mut CudaSlice<f32>,
    iters: usize,
    barrier: &Barrier,
) -> Result<f64> {
    let s = gpu.stream.clone();
    let mut call = || -> Result<()> {
        match path {
            Path::Copy => util.copy(&s, src, buf),
            Path::Lines | Path::Flags => comm.all_reduce(buf),
            Path::Nccl => comm.all_reduce_nccl(buf),
        }
    };
    // One eager call first: NCCL sets up lazily, outside any capture.
    call()?;
    comm.wait("bench all-reduce")?;
    barrier.wait();
    let times = time_graph_with(
        gpu,
        CALLS,
        3,
        iters,
        || {
            barrier.wait();
        },
        call,
    )?;
    // A peer that never arrived ends the one-shot kernels early: fail rather than report.
    comm.wait("bench all-reduce")?;
    Ok(times[times.len() / 2] * 1e3)
}
