//! The `grpc-timeout` header (gRPC over HTTP/2 spec: up to 8 digits and a unit).
//! tonic enforces it only until the response headers; a streaming response must be
//! cut by the handler itself, which is what the parsed deadline is for.

use std::time::Duration;
use tonic::metadata::MetadataMap;

/// The client's timeout, if it sent one that parses.
pub fn grpc_timeout(md: &MetadataMap) -> Option<Duration> {
    parse(md.get("grpc-timeout")?.to_str().ok()?)
}

fn parse(v: &str) -> Option<Duration> {
    if v.len() < 2 || v.len() > 9 {
        return None;
    }
    let (digits, unit) = v.split_at(v.len() - 1);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse("100m"), Some(Duration::from_millis(100)));
        assert_eq!(parse("2S"), Some(Duration::from_secs(2)));
        assert_eq!(parse("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse("5x"), None);
        assert_eq!(parse("123456789S"), None, "more than 8 digits");
        assert_eq!(parse("S"), None);
    }
}
