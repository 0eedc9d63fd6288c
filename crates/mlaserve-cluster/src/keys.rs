//! The etcd key layout of a cluster, written and read in one place so the two sides
//! cannot drift apart.
//!
//! A group's leader puts `/mlaserve/<cluster>/groups/<group>` = [`Registration`] (JSON)
//! under a lease it keeps alive, once every rank is ready; when the leader dies the
//! lease expires and the key vanishes. `/mlaserve/<cluster>/groups/<group>/nccl_id`
//! holds the group's NCCL unique ids (hex) while the ranks bootstrap. Routers watch the
//! groups prefix and ignore keys deeper than a group's own.

use serde::{Deserialize, Serialize};

/// The key prefix under which the groups of `cluster` register.
pub fn groups_prefix(cluster: &str) -> String {
    format!("/mlaserve/{cluster}/groups/")
}

/// The key a group registers under.
pub fn group_key(cluster: &str, group: &str) -> String {
    format!("{}{group}", groups_prefix(cluster))
}

/// The key of a group's NCCL unique ids.
pub fn nccl_id_key(cluster: &str, group: &str) -> String {
    format!("{}/nccl_id", group_key(cluster, group))
}

/// What a registered group advertises.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// The leader's gRPC address, `http://host:port`.
    pub addr: String,
    /// Ranks (GPUs) in the group.
    #[serde(default)]
    pub tp_size: u32,
}

/// The group named by `key` under `prefix` (from [`groups_prefix`]), with its
/// registration when `value` is given; `None` for deeper keys (a group's NCCL ids),
/// foreign keys and malformed values.
pub fn parse_group(prefix: &str, key: &[u8], value: Option<&[u8]>) -> Option<(String, Option<Registration>)> {
    let key = std::str::from_utf8(key).ok()?;
    let name = key.strip_prefix(prefix)?;
    if name.is_empty() || name.contains('/') {
        return None;
    }
    let reg = match value {
        Some(v) => match serde_json::from_slice::<Registration>(v) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!(key, error = %e, "ignoring a malformed group registration");
                return None;
            }
        },
        None => None,
    };
    Some((name.to_string(), reg))
}

/// `host:port` → `http://host:port` (how addresses are stored and dialled).
pub fn normalize_addr(a: &str) -> String {
    if a.contains("://") {
        a.to_string()
    } else {
        format!("http://{a}")
    }
}

/// `bytes` as lower-case hex (how NCCL ids are stored).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|x| format!("{x:02x}")).collect()
}

/// The bytes of a hex string; `None` if it is not hex.
pub fn unhex(s: &[u8]) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    s.chunks(2).map(|p| u8::from_str_radix(std::str::from_utf8(p).ok()?, 16).ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_parsing() {
        let p = groups_prefix("prod");
        assert_eq!(group_key("prod", "g0"), "/mlaserve/prod/groups/g0");
        assert_eq!(nccl_id_key("prod", "g0"), "/mlaserve/prod/groups/g0/nccl_id");
        let v = br#"{"addr":"http://10.0.0.1:7000","tp_size":8}"#;
        let (name, reg) = parse_group(&p, b"/mlaserve/prod/groups/g0", Some(v)).expect("parsed");
        assert_eq!(name, "g0");
        let reg = reg.expect("a registration");
        assert_eq!((reg.addr.as_str(), reg.tp_size), ("http://10.0.0.1:7000", 8));
        assert_eq!(parse_group(&p, b"/mlaserve/prod/groups/g0", None), Some(("g0".into(), None)));
        assert!(parse_group(&p, nccl_id_key("prod", "g0").as_bytes(), Some(b"xx")).is_none(), "deeper keys ignored");
        assert!(parse_group(&p, b"/mlaserve/prod/groups/g1", Some(b"not json")).is_none());
        assert!(parse_group(&p, b"/mlaserve/other/groups/g1", Some(v)).is_none());
    }

    #[test]
    fn addresses_get_a_scheme() {
        assert_eq!(normalize_addr("127.0.0.1:5"), "http://127.0.0.1:5");
        assert_eq!(normalize_addr("http://h:5"), "http://h:5");
    }

    #[test]
    fn hex_round_trip() {
        let b: Vec<u8> = (0..=255).collect();
        assert_eq!(unhex(hex(&b).as_bytes()).unwrap(), b);
        assert!(unhex(b"abc").is_none());
        assert!(unhex(b"zz").is_none());
    }
}
