//! Helm's template engine and the Kubernetes schema validator, as CI installs them:
//! `tools/ci/install-k8s-validate.sh` puts `helm-python-sdk` (Helm's Go SDK as a shared
//! library; `tests/common/helm.py` drives it) and `kubernetes-validate` (the API's JSON
//! schemas, bundled) in `<repo>/.venv-k8s`, or the venv `MLASERVE_K8S_VENV` names.
//!
//! [`Tools::find`] panics when they are missing and `CI` is set, so CI can never pass
//! without rendering and validating; elsewhere it returns `None` and the test says it
//! skipped.

use super::chart::Chart;
use super::repo_root;
use serde_yaml_ng::Value;
use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// API groups of CustomResourceDefinitions the chart may create; kubernetes-validate has
/// no schema for them, so a manifest there is reported and not checked. Any other
/// manifest without a schema (a mistyped `apiVersion` or `kind`) is an error.
pub const CRD_GROUPS: &[&str] = &["monitoring.coreos.com"];

/// The venv's interpreter and validator.
#[derive(Debug)]
pub struct Tools {
    python: PathBuf,
    validator: PathBuf,
}

/// What a validation run found valid.
#[derive(Debug)]
pub struct Validated {
    /// `kind/name against X.Y` for every resource checked, per Kubernetes version.
    pub passed: Vec<String>,
    /// `kind (apiVersion)` of custom resources that have no schema here.
    pub unchecked: Vec<String>,
}

fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "0" && v != "false")
}

impl Tools {
    /// The tools, or `None` (the caller skips) when they are not installed outside CI.
    pub fn find() -> Option<&'static Tools> {
        static TOOLS: OnceLock<Result<Tools, String>> = OnceLock::new();
        let found = TOOLS.get_or_init(|| {
            let venv = std::env::var_os("MLASERVE_K8S_VENV")
                .map(PathBuf::from)
                .unwrap_or_else(|| repo_root().join(".venv-k8s"));
            let t = Tools { python: venv.join("bin/python"), validator: venv.join("bin/kubernetes-validate") };
            let ok = t.validator.is_file()
                && Command::new(&t.python)
                    .args(["-c", "import helm_python"])
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success());
            if ok {
                Ok(t)
            } else {
                Err(format!(
                    "helm-python-sdk and kubernetes-validate are not installed in {}: run \
                     tools/ci/install-k8s-validate.sh",
                    venv.display()
                ))
            }
        });
        match found {
            Ok(t) => Some(t),
            Err(e) if in_ci() => panic!("{e} (CI is set: the chart must be rendered and validated)"),
            Err(e) => {
                eprintln!("SKIPPED: {e}");
                None
            }
        }
    }

    /// Runs `tests/common/helm.py` with `op` on `chart` as release `release`.
    fn helm(&self, op: &str, chart: &Chart, release: &str) -> Result<serde_json::Value, String> {
        let req = serde_json::json!({
            "op": op,
            "chart": chart.dir,
            "release": release,
            "namespace": "default",
            "values": serde_json::to_value(&chart.values).map_err(|e| e.to_string())?,
        });
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/common/helm.py");
        let mut child = Command::new(&self.python)
            .arg(script)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("{}: {e}", self.python.display()))?;
        child.stdin.take().expect("stdin").write_all(req.to_string().as_bytes()).map_err(|e| e.to_string())?;
        let out = child.wait_with_output().map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!("helm {op} failed: {}", String::from_utf8_lossy(&out.stderr)));
        }
        serde_json::from_slice(&out.stdout).map_err(|e| format!("helm {op}: bad answer: {e}"))
    }

    /// Renders every manifest template (not `NOTES.txt`) as `helm template` would;
    /// returns `(template file name, rendered text)` in file order.
    pub fn render(&self, chart: &Chart, release: &str) -> Result<Vec<(String, String)>, String> {
        let files = self.helm("render", chart, release)?;
        let mut out: Vec<(String, String)> = files
            .as_object()
            .ok_or("helm render: not a mapping")?
            .iter()
            .filter(|(name, _)| name.ends_with(".yaml") || name.ends_with(".yml"))
            .map(|(name, text)| {
                let file = name.rsplit('/').next().unwrap_or(name).to_string();
                (file, text.as_str().unwrap_or_default().to_string())
            })
            .collect();
        out.sort();
        Ok(out)
    }

    /// Renders and parses every manifest: the non-empty YAML documents, in file order.
    pub fn manifests(&self, chart: &Chart, release: &str) -> Result<Vec<Value>, String> {
        let mut docs = Vec::new();
        for (name, text) in self.render(chart, release)? {
            for doc in serde_yaml_ng::Deserializer::from_str(&text) {
                let v = <Value as serde::Deserialize>::deserialize(doc)
                    .map_err(|e| format!("{name} does not render to valid YAML: {e}\n{text}"))?;
                if !v.is_null() {
                    docs.push(v);
                }
            }
        }
        Ok(docs)
    }

    /// `helm lint` of the chart with its values: the findings that are warnings or
    /// errors, as `severity path: message`.
    pub fn lint(&self, chart: &Chart) -> Result<Vec<String>, String> {
        let report = self.helm("lint", chart, "lint")?;
        let mut findings: Vec<String> =
            report["errors"].as_array().into_iter().flatten().map(|e| format!("error: {e}")).collect();
        for m in report["messages"].as_array().into_iter().flatten() {
            if m["severity"].as_u64().unwrap_or(3) >= 2 {
                findings.push(format!("{} {}: {}", m["severity"], m["path"], m["error"]));
            }
        }
        Ok(findings)
    }

    /// Validates the YAML stream `yaml` with `kubernetes-validate --strict` (unknown
    /// fields are errors) against each of `kube_versions`. Errs on any invalid resource,
    /// on a resource without a schema outside [`CRD_GROUPS`], and on a failed run.
    pub fn validate(&self, yaml: &str, kube_versions: &[String]) -> Result<Validated, String> {
        let mut file = tempfile::Builder::new().suffix(".yaml").tempfile().map_err(|e| e.to_string())?;
        file.write_all(yaml.as_bytes()).map_err(|e| e.to_string())?;
        let mut cmd = Command::new(&self.validator);
        cmd.arg("--strict");
        for v in kube_versions {
            cmd.args(["-k", v]);
        }
        let out = cmd.arg(file.path()).output().map_err(|e| format!("{}: {e}", self.validator.display()))?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        let path = file.path().display().to_string();
        let mut v = Validated { passed: Vec::new(), unchecked: Vec::new() };
        let mut errors = Vec::new();
        for line in text.lines().map(|l| l.replace(&path, "<manifests>")) {
            if let Some(rest) = line.strip_prefix("INFO <manifests> passed for resource ") {
                v.passed.push(rest.replace(" against version ", " against "));
            } else if let Some(rest) = line.strip_prefix("WARN <manifests> Couldn't find schema for kind ") {
                // "<Kind> with api version <group/version> for kubernetes version <X.Y>"
                let (kind, api) = rest.split_once(" with api version ").unwrap_or((rest, ""));
                let api = api.split(' ').next().unwrap_or_default();
                if CRD_GROUPS.iter().any(|g| api.starts_with(&format!("{g}/"))) {
                    v.unchecked.push(format!("{kind} ({api})"));
                } else {
                    errors.push(format!("no schema for {kind} {api}: a mistyped apiVersion or kind?"));
                }
            } else if !line.trim().is_empty() {
                errors.push(line);
            }
        }
        if !out.status.success() && errors.is_empty() {
            errors.push(format!("kubernetes-validate exited with {}", out.status));
        }
        if errors.is_empty() {
            v.unchecked.sort();
            v.unchecked.dedup();
            Ok(v)
        } else {
            Err(errors.join("\n"))
        }
    }
}

/// The YAML stream of `docs` (for validating manifests a test changed).
pub fn to_yaml_stream(docs: &[Value]) -> String {
    docs.iter().map(|d| format!("---\n{}", serde_yaml_ng::to_string(d).expect("serialize"))).collect()
}
