//! TCP rendezvous: the leader serves a payload (the NCCL unique id) to the group.
//!
//! Protocol, all integers little-endian: a follower connects to the leader and sends
//! `b"MLTP"`, its rank (u32), the world size (u32), the group name (u32 length + bytes);
//! once every follower has checked in, the leader answers each with the payload (u32
//! length + bytes). A follower retries connecting until its deadline, so ranks may start
//! in any order. Any mismatch (world size, group, a duplicate or out-of-range rank) is an
//! error naming it, on both sides.

use mlaserve_core::{Error, Result};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 4] = b"MLTP";

fn err(msg: impl Into<String>) -> Error {
    Error::Collective(format!("rendezvous: {}", msg.into()))
}

/// The leader's side: waits (until `timeout`) for ranks `1..world` of `group` on
/// `listener`, then sends each the payload.
pub fn serve(listener: &TcpListener, group: &str, world: usize, payload: &[u8], timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    listener.set_nonblocking(true).map_err(|e| err(format!("listener: {e}")))?;
    let mut peers: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    while peers.iter().skip(1).any(|p| p.is_none()) {
        match listener.accept() {
            Ok((mut s, from)) => {
                s.set_nonblocking(false).map_err(|e| err(e.to_string()))?;
                s.set_read_timeout(Some(Duration::from_secs(5))).map_err(|e| err(e.to_string()))?;
                let (rank, their_world, their_group) =
                    read_hello(&mut s).map_err(|e| err(format!("bad hello from {from}: {e}")))?;
                let problem = if their_group != group {
                    Some(format!("rank {rank} from {from} belongs to group {their_group:?}, expected {group:?}"))
                } else if their_world != world {
                    Some(format!("rank {rank} from {from} says world size {their_world}, expected {world}"))
                } else if rank == 0 || rank >= world {
                    Some(format!("rank {rank} from {from} is out of range 1..{world}"))
                } else if peers[rank].is_some() {
                    Some(format!("rank {rank} checked in twice (again from {from})"))
                } else {
                    None
                };
                if let Some(p) = problem {
                    let _ = write_frame(&mut s, format!("ERR {p}").as_bytes());
                    return Err(err(p));
                }
                peers[rank] = Some(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<usize> = (1..world).filter(|&r| peers[r].is_none()).collect();
                    return Err(err(format!("timed out after {timeout:?}; ranks {missing:?} never checked in")));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(err(format!("accept: {e}"))),
        }
    }
    for (rank, p) in peers.iter_mut().enumerate().skip(1) {
        if let Some(s) = p {
            let mut framed = b"OK  ".to_vec();
            framed.extend_from_slice(payload);
            write_frame(s, &framed).map_err(|e| err(format!("sending to rank {rank}: {e}")))?;
        }
    }
    Ok(())
}

/// A follower's side: connects to the leader at `leader` (retrying until `timeout`),
/// checks in as `rank` of `group`, and returns the payload.
pub fn join(leader: SocketAddr, group: &str, rank: usize, world: usize, timeout: Duration) -> Result<Vec<u8>> {
    let deadline = Instant::now() + timeout;
    let mut s = loop {
        match TcpStream::connect_timeout(&leader, Duration::from_secs(1)) {
            Ok(s) => break s,
            Err(e) => {
                if Instant::now() >= deadline {
                    return Err(err(format!("rank {rank}: leader {leader} unreachable for {timeout:?}: {e}")));
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    };
    let remaining = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100));
    s.set_read_timeout(Some(remaining)).map_err(|e| err(e.to_string()))?;
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&(rank as u32).to_le_bytes());
    hello.extend_from_slice(&(world as u32).to_le_bytes());
    hello.extend_from_slice(&(group.len() as u32).to_le_bytes());
    hello.extend_from_slice(group.as_bytes());
    s.write_all(&hello).map_err(|e| err(format!("rank {rank}: {e}")))?;
    let frame = read_frame(&mut s).map_err(|e| err(format!("rank {rank}: waiting for the leader: {e}")))?;
    match frame.get(..4) {
        Some(b"OK  ") => Ok(frame[4..].to_vec()),
        _ => Err(err(format!("rank {rank}: leader refused: {}", String::from_utf8_lossy(&frame)))),
    }
}

fn read_u32(s: &mut TcpStream) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    s.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_hello(s: &mut TcpStream) -> std::io::Result<(usize, usize, String)> {
    let mut magic = [0u8; 4];
    s.read_exact(&mut magic)?;
    if &magic != MAGIC {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "not an mlaserve rank"));
    }
    let rank = read_u32(s)? as usize;
    let world = read_u32(s)? as usize;
    let n = read_u32(s)? as usize;
    if n > 4096 {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "group name too long"));
    }
    let mut g = vec![0u8; n];
    s.read_exact(&mut g)?;
    Ok((rank, world, String::from_utf8_lossy(&g).into_owned()))
}

fn write_frame(s: &mut TcpStream, b: &[u8]) -> std::io::Result<()> {
    s.write_all(&(b.len() as u32).to_le_bytes())?;
    s.write_all(b)
}

fn read_frame(s: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let n = read_u32(s)? as usize;
    if n > 1 << 20 {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "frame too large"));
    }
    let mut b = vec![0u8; n];
    s.read_exact(&mut b)?;
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listener() -> (TcpListener, SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = l.local_addr().unwrap();
        (l, a)
    }

    #[test]
    fn every_follower_gets_the_payload_whatever_the_start_order() {
        let (l, addr) = listener();
        let payload: Vec<u8> = (0..128u8).collect();
        let got: Vec<Vec<u8>> = std::thread::scope(|s| {
            let fs: Vec<_> =
                (1..4).map(|r| s.spawn(move || join(addr, "g", r, 4, Duration::from_secs(10)).unwrap())).collect();
            // The leader starts late: followers retry.
            std::thread::sleep(Duration::from_millis(300));
            serve(&l, "g", 4, &payload, Duration::from_secs(10)).unwrap();
            fs.into_iter().map(|f| f.join().unwrap()).collect()
        });
        assert!(got.iter().all(|g| g == &payload));
    }

    #[test]
    fn mismatches_and_timeouts_are_named() {
        let (l, addr) = listener();
        let e = std::thread::scope(|s| {
            let f = s.spawn(move || join(addr, "g", 1, 3, Duration::from_secs(5)));
            let e = serve(&l, "g", 2, b"x", Duration::from_secs(5)).unwrap_err().to_string();
            let fe = f.join().unwrap().unwrap_err().to_string();
            assert!(fe.contains("leader refused") && fe.contains("world size 3"), "{fe}");
            e
        });
        assert!(e.contains("world size 3, expected 2"), "{e}");

        let (l, _) = listener();
        let e = serve(&l, "g", 3, b"x", Duration::from_millis(300)).unwrap_err().to_string();
        assert!(e.contains("ranks [1, 2] never checked in"), "{e}");

        let (_, addr) = listener(); // dropped: nobody listens
        let e = join(addr, "g", 1, 2, Duration::from_millis(500)).unwrap_err().to_string();
        assert!(e.contains("unreachable"), "{e}");
    }
}
