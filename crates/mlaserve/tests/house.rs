//! The house rules of the workspace, checked on every test run:
//! - dependencies point down: each crate may depend (normal and build dependencies) only
//!   on the workspace crates its layer allows, read from `cargo metadata`; in particular
//!   neither server depends on the other, nor on a backend;
//! - no source file under `crates/` or `benches/` is longer than 800 lines (kernels aside);
//! - no library crate reads environment variables in its runtime code (settings are
//!   typed options set by flags; build scripts, tests and the binary's `main` aside).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Every workspace crate and the workspace crates it may depend on. A crate missing here
/// fails the test: placing a new crate is a decision, written down in this table.
const ALLOWED: &[(&str, &[&str])] = &[
    ("mlaserve-proto", &[]),
    ("mlaserve-core", &[]),
    ("mlaserve-model", &["mlaserve-core"]),
    ("mlaserve-tp", &["mlaserve-core"]),
    ("mlaserve-engine", &["mlaserve-core"]),
    ("mlaserve-cluster", &["mlaserve-proto"]),
    ("mlaserve-cpu", &["mlaserve-core", "mlaserve-model"]),
    ("mlaserve-cuda", &["mlaserve-core", "mlaserve-model", "mlaserve-tp"]),
    (
        "mlaserve-cuda-lab",
        &["mlaserve-core", "mlaserve-model", "mlaserve-tp", "mlaserve-cpu", "mlaserve-cuda", "mlaserve-engine"],
    ),
    ("mlaserve-worker", &["mlaserve-core", "mlaserve-model", "mlaserve-engine", "mlaserve-proto", "mlaserve-cluster"]),
    ("mlaserve-router", &["mlaserve-core", "mlaserve-model", "mlaserve-proto", "mlaserve-cluster"]),
    (
        "mlaserve",
        &[
            "mlaserve-core",
            "mlaserve-model",
            "mlaserve-tp",
            "mlaserve-engine",
            "mlaserve-cluster",
            "mlaserve-proto",
            "mlaserve-cpu",
            "mlaserve-cuda",
            "mlaserve-cuda-lab",
            "mlaserve-worker",
            "mlaserve-router",
        ],
    ),
    // Test and benchmark crates sit on top and may use anything below them.
    ("mlaserve-benches", &["*"]),
    ("mlaserve-e2e", &["*"]),
    ("mlaserve-deploy-tests", &["*"]),
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("workspace root")
}

/// `(crate, [(workspace dependency, kind)])` for every workspace crate.
fn workspace_deps() -> BTreeMap<String, Vec<(String, String)>> {
    let out = std::process::Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(root())
        .output()
        .expect("cargo metadata runs");
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata is JSON");
    let members: BTreeSet<String> =
        meta["packages"].as_array().unwrap().iter().map(|p| p["name"].as_str().unwrap().to_string()).collect();
    let mut deps = BTreeMap::new();
    for p in meta["packages"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap().to_string();
        let ds = p["dependencies"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| members.contains(d["name"].as_str().unwrap()))
            .map(|d| (d["name"].as_str().unwrap().to_string(), d["kind"].as_str().unwrap_or("normal").to_string()))
            .collect();
        deps.insert(name, ds);
    }
    deps
}

#[test]
fn dependencies_point_down() {
    let allowed: BTreeMap<&str, &[&str]> = ALLOWED.iter().copied().collect();
    let mut wrong = Vec::new();
    for (krate, deps) in workspace_deps() {
        let Some(ok) = allowed.get(krate.as_str()) else {
            wrong.push(format!("{krate}: not in the layer table of this test"));
            continue;
        };
        for (dep, kind) in deps {
            if kind != "dev" && !ok.contains(&"*") && !ok.contains(&dep.as_str()) {
                wrong.push(format!("{krate} -> {dep} ({kind})"));
            }
        }
    }
    assert!(wrong.is_empty(), "dependencies that point up or sideways:\n{}", wrong.join("\n"));
}

#[test]
fn the_servers_depend_on_neither_each_other_nor_a_backend() {
    let deps = workspace_deps();
    let normal = |k: &str| -> BTreeSet<String> {
        deps[k].iter().filter(|(_, kind)| kind != "dev").map(|(d, _)| d.clone()).collect()
    };
    for (server, forbidden) in [
        ("mlaserve-worker", ["mlaserve-router", "mlaserve-cpu", "mlaserve-cuda"]),
        ("mlaserve-router", ["mlaserve-worker", "mlaserve-cpu", "mlaserve-cuda"]),
    ] {
        let has = normal(server);
        for f in forbidden {
            assert!(!has.contains(f), "{server} depends on {f}");
        }
    }
}

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "target") {
                rust_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn no_source_file_is_over_800_lines() {
    let root = root();
    let mut files = Vec::new();
    rust_files(&root.join("crates"), &mut files);
    rust_files(&root.join("benches"), &mut files);
    assert!(files.len() > 50, "found only {} files under {}", files.len(), root.display());
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let n = std::fs::read_to_string(f).ok()?.lines().count();
            (n > 800).then(|| format!("{} ({n} lines)", f.strip_prefix(&root).unwrap_or(f).display()))
        })
        .collect();
    assert!(long.is_empty(), "files over 800 lines; split them:\n{}", long.join("\n"));
}

#[test]
fn library_crates_read_no_environment_variables() {
    let root = root();
    let mut files = Vec::new();
    for krate in std::fs::read_dir(root.join("crates")).unwrap().flatten() {
        rust_files(&krate.path().join("src"), &mut files);
    }
    let rel = |f: &Path| f.strip_prefix(&root).unwrap_or(f).to_string_lossy().into_owned();
    let exempt = |r: &str| r.starts_with("crates/mlaserve/src/main.rs") || r.contains("/src/bin/");
    let needle = ["env::", "var"].concat();
    let readers: Vec<String> = files
        .iter()
        .filter(|f| !exempt(&rel(f)))
        .filter(|f| std::fs::read_to_string(f).is_ok_and(|s| s.contains(&needle)))
        .map(|f| rel(f))
        .collect();
    assert!(
        readers.is_empty(),
        "library code reads environment variables (make them options):\n{}",
        readers.join("\n")
    );
}
