//! The crate's top-level modules import each other without a cycle: shared helpers live
//! in leaf modules (launch helpers, tensor maps, shapes), never in the files that use
//! them. Parses every `src/**/*.rs` for `crate::…` and `super::…` paths (whatever the
//! `cfg`, so it runs without CUDA) and fails naming the cycle it finds.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("read src") {
        let p = e.expect("entry").path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The module path of a file below `src` (`ops/moe.rs` → `[ops, moe]`, `ops/mod.rs` →
/// `[ops]`, `lib.rs` → `[]`).
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel.iter().map(|c| c.to_string_lossy().into_owned()).collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_string());
    }
    parts
}

/// The source without comments (doc links name modules without importing them).
fn strip_comments(src: &str) -> String {
    src.lines().map(|l| l.find("//").map_or(l, |i| &l[..i])).collect::<Vec<_>>().join("\n")
}

fn ident_at(s: &str) -> &str {
    let end = s.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(s.len());
    &s[..end]
}

/// The first path segments after `prefix` in `src`: `crate::a::b` → `a`;
/// `crate::{a, b::C}` → `a`, `b`.
fn first_segments(src: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, _) in src.match_indices(prefix) {
        // Not the tail of a longer identifier (`my_crate::`).
        if src[..i].chars().next_back().is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &src[i + prefix.len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let (mut depth, mut start) = (0usize, 0usize);
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        out.push(ident_at(group[start..].trim_start()).to_string());
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push(ident_at(group[start..].trim_start()).to_string());
                        start = j + 1;
                    }
                    _ => {}
                }
            }
        } else {
            out.push(ident_at(rest).to_string());
        }
    }
    out.retain(|s| !s.is_empty() && s != "self");
    out
}

/// Top-level module → the top-level modules it refers to.
fn graph(src_dir: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    sources(src_dir, &mut files);
    let tops: BTreeSet<String> =
        files.iter().filter_map(|f| module_path(f.strip_prefix(src_dir).ok()?).first().cloned()).collect();
    // Names the crate root re-exports (`pub use backend::{CudaBackend, …}`) → their module.
    let lib = strip_comments(&std::fs::read_to_string(src_dir.join("lib.rs")).expect("lib.rs"));
    let mut reexports = BTreeMap::new();
    for stmt in lib.split(';') {
        let Some(i) = stmt.find("pub use ") else { continue };
        let path = stmt[i + "pub use ".len()..].trim();
        let module = ident_at(path).to_string();
        for name in path.split(|c: char| !(c.is_alphanumeric() || c == '_')).skip(1) {
            if !name.is_empty() {
                reexports.insert(name.to_string(), module.clone());
            }
        }
    }
    let mut g: BTreeMap<String, BTreeSet<String>> = tops.iter().map(|t| (t.clone(), BTreeSet::new())).collect();
    for f in &files {
        let modpath = module_path(f.strip_prefix(src_dir).expect("below src"));
        let Some(top) = modpath.first().cloned() else { continue }; // lib.rs: the root
        let src = strip_comments(&std::fs::read_to_string(f).expect("read"));
        let mut targets = first_segments(&src, "crate::");
        // `super::x` from a file at depth ≥ 2 names a sibling below the same top-level
        // module, except from depth 2, where `super::` is the top-level module itself;
        // `super::super::x` from depth 2 leaves it. (Inline `mod tests` blocks count as
        // their file.)
        for (i, _) in src.match_indices("super::super::") {
            if modpath.len() == 2 {
                targets.push(ident_at(&src[i + "super::super::".len()..]).to_string());
            }
        }
        for t in targets {
            let t = if tops.contains(&t) { Some(t) } else { reexports.get(&t).cloned() };
            if let Some(t) = t.filter(|t| *t != top) {
                g.get_mut(&top).expect("top").insert(t);
            }
        }
    }
    g
}

/// A cycle of `g`, if there is one, as the modules along it.
fn find_cycle(g: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(n.to_string(), 1);
        stack.push(n.to_string());
        for m in g.get(n).into_iter().flatten() {
            match state.get(m.as_str()).copied().unwrap_or(0) {
                1 => {
                    let at = stack.iter().position(|s| s == m).expect("on the stack");
                    let mut cycle = stack[at..].to_vec();
                    cycle.push(m.clone());
                    return Some(cycle);
                }
                0 => {
                    if let Some(c) = visit(m, g, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for n in g.keys() {
        if state.get(n.as_str()).copied().unwrap_or(0) == 0 {
            if let Some(c) = visit(n, g, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

#[test]
fn top_level_modules_import_without_a_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let g = graph(&src);
    assert!(g.contains_key("backend") && g.contains_key("ops"), "modules not found: {g:?}");
    assert!(g["ops"].contains("launch"), "the parser misses `use crate::…` lines: {g:?}");
    if let Some(c) = find_cycle(&g) {
        panic!("import cycle between top-level modules: {}\nfull graph: {g:#?}", c.join(" → "));
    }
}

#[test]
fn the_cycle_finder_finds_cycles() {
    let edges = |v: &[(&str, &str)]| {
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in v {
            g.entry(a.to_string()).or_default().insert(b.to_string());
            g.entry(b.to_string()).or_default();
        }
        g
    };
    assert_eq!(find_cycle(&edges(&[("a", "b"), ("b", "c"), ("a", "c")])), None);
    let c = find_cycle(&edges(&[("a", "b"), ("b", "c"), ("c", "a")])).expect("a cycle");
    assert_eq!(c.first(), c.last());
    assert_eq!(c.len(), 4);
    assert_eq!(
        first_segments("use crate::{a::X, b, c::{D, E}};\nlet x = crate::d::f();", "crate::"),
        ["a", "b", "c", "d"]
    );
    assert!(first_segments("use my_crate::a;", "crate::").is_empty());
}
