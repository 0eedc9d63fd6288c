//! The tensor-parallel all-reduce of `DeviceComm` on two GPUs, the one-shot kernels over
//! peer memory (`peer.rs`) against the host's sum in rank order, bit for bit: message
//! lengths around the kernels' slicing and their 32 blocks up to the cap, each length
//! three times (both halves of the buffers, the calls counting on), once through each
//! kernel (the flag barrier, the lines, the automatic choice: switching between them
//! from call to call, as the sizes of a step do), eagerly and
//! replayed from a CUDA graph with fresh inputs between replays, and one float over the
//! cap (NCCL's ordered all-reduce then, the same bits); all-gathers through the same
//! kernel, exactly the ranks' inputs. Twice: ranks as threads of one
//! process (peer access by address) and as two processes (CUDA IPC handles), the second
//! rank this test binary started again.
#![cfg(feature = "cuda")]

mod common;

use std::time::Duration;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use mlaserve_cuda::linear::TcKernels;
use mlaserve_cuda::ops::Ops;
use mlaserve_cuda::{DeviceComm, Gpu, TpInit};

const WORLD: usize = 2;
const MAX_BYTES: usize = 64 << 10;
/// Set in the second process of the cross-process test: the NCCL id in hex.
const CHILD_ID: &str = "MLASERVE_TEST_COMM_CHILD_ID";

/// Rank `rank`'s input for call `call`: signs, magnitudes and exponents spread so that
/// the order of a sum shows in its bits.
fn input(rank: usize, call: usize, n: usize) -> Vec<f32> {
    let mut s =
        (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (call as u64 + 7).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let m = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            m * [1.0f32, 1e-3, 37.0, 3e4][(s & 3) as usize]
        })
        .collect()
}

/// The sum in rank order 0, 1, … as bits.
fn want(call: usize, n: usize) -> Vec<u32> {
    let parts: Vec<Vec<f32>> = (0..WORLD).map(|r| input(r, call, n)).collect();
    (0..n)
        .map(|i| {
            let mut t = parts[0][i];
            for p in &parts[1..] {
                t += p[i];
            }
            t.to_bits()
        })
        .collect()
}

/// The largest message of the lines kernel for call `call`: the flag barrier at every
/// size, lines at every size, and lines up to half the cap, in turn (consecutive calls
/// switch kernels).
fn lines_max(call: usize) -> usize {
    [0, MAX_BYTES / 4, MAX_BYTES / 8][call % 3]
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn first_diff(got: &[u32], want: &[u32]) -> Option<usize> {
    got.iter().zip(want).position(|(a, b)| a != b)
}

/// One rank's whole check.
fn rank_body(rank: usize, id: Vec<u8>) {
    let gpu = Gpu::new(rank).expect("GPU");
    let s = gpu.stream.clone();
    let init = TpInit { rank, world: WORLD, id, timeout: Duration::from_secs(60) };
    let mut comm = DeviceComm::new(&s, &init).expect("NCCL");
    assert!(
        comm.enable_peer_reduce(&gpu, MAX_BYTES, MAX_BYTES).expect("peer setup"),
        "the GPUs reach each other directly"
    );
    let cap = comm.peer_reduce_cap().expect("enabled");
    assert_eq!(cap, MAX_BYTES / 4);
    assert_eq!(comm.peer_lines_max(), Some(cap), "lines up to the asked bytes");
    let ops = Ops::new(&gpu, TcKernels::Auto).expect("ops");
    let lens = [1, 3, 4, 5, 31, 127, 128, 129, 1000, 4097, 7168, cap - 1, cap];
    let mut call = 0;
    for n in lens {
        for _ in 0..3 {
            let mut buf = s.clone_htod(&input(rank, call, n)).expect("upload");
            comm.set_peer_lines_max(lines_max(call));
            if call % 2 == 0 {
                comm.all_reduce(&mut buf).expect("all_reduce");
            } else {
                comm.all_reduce_ordered(&ops, &mut buf).expect("all_reduce_ordered");
            }
            comm.wait("test").expect("wait");
            let got = bits(&s.clone_dtoh(&buf).expect("download"));
            let w = want(call, n);
            let l = lines_max(call);
            assert_eq!(
                first_diff(&got, &w),
                None,
                "rank {rank}: {n} floats, call {call} (lines ≤ {l}): not the rank-order sum"
            );
            call += 1;
        }
    }
    // All-gathers through the same kernel (its slots copied out rank-major): exactly the
    // ranks' inputs, and one float over the cap through NCCL.
    for n in [1, 5, 129, 4097, cap, cap + 1] {
        let local = s.clone_htod(&input(rank, call, n)).expect("upload");
        let mut all = s.alloc_zeros::<f32>(WORLD * n).expect("alloc");
        comm.set_peer_lines_max(lines_max(call));
        comm.all_gather(&local, &mut all).expect("all_gather");
        comm.wait("test").expect("wait");
        let want: Vec<u32> = (0..WORLD).flat_map(|r| bits(&input(r, call, n))).collect();
        let got = bits(&s.clone_dtoh(&all).expect("download"));
        assert_eq!(first_diff(&got, &want), None, "rank {rank}: all-gather of {n} floats, call {call}");
        call += 1;
    }
    // One float over the cap: NCCL's all-gather and the ordered sum, the same bits.
    let n = cap + 1;
    let mut buf = s.clone_htod(&input(rank, call, n)).expect("upload");
    comm.all_reduce_ordered(&ops, &mut buf).expect("ordered over the cap");
    comm.wait("test").expect("wait");
    assert_eq!(first_diff(&bits(&s.clone_dtoh(&buf).expect("download")), &want(call, n)), None, "over the cap");
    call += 1;

    // A CUDA graph of two all-reduces of 7168 + 1 floats, replayed with fresh inputs.
    let n = 7169;
    let mut a = s.alloc_zeros::<f32>(n).expect("alloc");
    let mut b = s.alloc_zeros::<f32>(n).expect("alloc");
    s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).expect("begin capture");
    comm.set_peer_lines_max(cap);
    comm.all_reduce(&mut a).expect("captured all_reduce");
    comm.set_peer_lines_max(0);
    comm.all_reduce_ordered(&ops, &mut b).expect("captured all_reduce_ordered");
    comm.set_peer_lines_max(cap);
    let graph = s.end_capture(CUgraphInstantiate_flags(0)).expect("end capture").expect("a graph");
    for replay in 0..5 {
        s.memcpy_htod(&input(rank, call, n), &mut a).expect("refill a");
        s.memcpy_htod(&input(rank, call + 1, n), &mut b).expect("refill b");
        graph.launch().expect("replay");
        comm.wait("test").expect("wait");
        let (ga, gb) = (s.clone_dtoh(&a).expect("a"), s.clone_dtoh(&b).expect("b"));
        assert_eq!(first_diff(&bits(&ga), &want(call, n)), None, "rank {rank}: graph replay {replay}, first");
        assert_eq!(first_diff(&bits(&gb), &want(call + 1, n)), None, "rank {rank}: graph replay {replay}, second");
        call += 2;
    }
    // Eager calls still agree after the replays (the graph's calls counted on the device).
    let mut buf = s.clone_htod(&input(rank, call, 129)).expect("upload");
    comm.all_reduce(&mut buf).expect("all_reduce after replays");
    comm.wait("test").expect("wait");
    assert_eq!(first_diff(&bits(&s.clone_dtoh(&buf).expect("download")), &want(call, 129)), None, "after replays");
    drop(graph);
}

#[test]
fn peer_all_reduce_equals_the_rank_order_sum_threads() {
    if !common::require_gpus(WORLD) {
        return;
    }
    let id = TpInit::new_id().expect("NCCL id");
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..WORLD)
            .map(|r| {
                let id = id.clone();
                sc.spawn(move || rank_body(r, id))
            })
            .collect();
        for h in hs {
            h.join().expect("rank thread");
        }
    });
}

#[test]
fn peer_all_reduce_equals_the_rank_order_sum_processes() {
    if let Ok(hex) = std::env::var(CHILD_ID) {
        let id = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex")).collect();
        rank_body(1, id);
        return;
    }
    if !common::require_gpus(WORLD) {
        return;
    }
    let id = TpInit::new_id().expect("NCCL id");
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    let mut child = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "peer_all_reduce_equals_the_rank_order_sum_processes", "--nocapture", "--test-threads=1"])
        .env(CHILD_ID, hex)
        .spawn()
        .expect("second rank");
    rank_body(0, id);
    assert!(child.wait().expect("wait for rank 1").success(), "rank 1 failed");
}

/// A peer that stops calling: the one-shot kernel gives up after the timeout (it returns,
/// so the stream drains instead of spinning), the wait fails naming a stalled peer, and
/// the communicator stays failed: the next call fails at once.
#[test]
fn a_stalled_peer_fails_the_flag_kernel_within_the_timeout() {
    stalled_peer(0);
}

/// The same with the lines kernel.
#[test]
fn a_stalled_peer_fails_the_lines_kernel_within_the_timeout() {
    stalled_peer(MAX_BYTES / 4);
}

fn stalled_peer(lines_max: usize) {
    if !common::require_gpus(WORLD) {
        return;
    }
    let id = TpInit::new_id().expect("NCCL id");
    let timeout = Duration::from_secs(3);
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|sc| {
        let id1 = id.clone();
        let staller = sc.spawn(move || {
            let gpu = Gpu::new(1).expect("GPU 1");
            let init = TpInit { rank: 1, world: WORLD, id: id1, timeout };
            let mut comm = DeviceComm::new(&gpu.stream, &init).expect("NCCL");
            assert!(comm.enable_peer_reduce(&gpu, MAX_BYTES, MAX_BYTES).expect("peer setup"));
            comm.set_peer_lines_max(lines_max);
            let mut buf = gpu.stream.clone_htod(&input(1, 0, 100)).expect("upload");
            comm.all_reduce(&mut buf).expect("rank 1's call");
            comm.wait("rank 1").expect("rank 1's wait");
            let _ = rx.recv(); // then no call until released
        });
        let gpu = Gpu::new(0).expect("GPU 0");
        let s = gpu.stream.clone();
        let mut comm = DeviceComm::new(&s, &TpInit { rank: 0, world: WORLD, id, timeout }).expect("NCCL");
        assert!(comm.enable_peer_reduce(&gpu, MAX_BYTES, MAX_BYTES).expect("peer setup"));
        comm.set_peer_lines_max(lines_max);
        let mut buf = s.clone_htod(&input(0, 0, 100)).expect("upload");
        comm.all_reduce(&mut buf).expect("first call");
        comm.wait("first").expect("both ranks took part");
        assert_eq!(first_diff(&bits(&s.clone_dtoh(&buf).expect("download")), &want(0, 100)), None);
        let t0 = std::time::Instant::now();
        comm.all_reduce(&mut buf).expect("enqueued");
        let err = comm.wait("second").expect_err("a call without the peer must fail").to_string();
        let waited = t0.elapsed();
        println!("stalled peer: the wait failed after {waited:?}: {err}");
        assert!(waited < timeout + Duration::from_secs(3), "took {waited:?}");
        assert!(err.contains("died or stalls"), "{err}");
        let again = comm.all_reduce(&mut buf).expect_err("the group stays failed").to_string();
        assert!(again.contains("aborted"), "{again}");
        drop(comm);
        drop(tx);
        staller.join().expect("staller");
    });
}
