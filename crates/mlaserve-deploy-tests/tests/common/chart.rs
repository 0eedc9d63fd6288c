//! The Helm chart as files: `Chart.yaml`, `values.yaml` (which tests override with
//! [`set_value`]) and the template sources. Rendering is Helm's own, in [`super::k8s`].

use serde_yaml_ng::Value;
use std::path::{Path, PathBuf};

/// The chart: its directory, metadata, values and templates.
#[derive(Debug, Clone)]
pub struct Chart {
    /// The chart directory (`helm/mlaserve`).
    pub dir: PathBuf,
    /// `Chart.yaml`.
    pub meta: Value,
    /// `values.yaml`; what a render uses (tests override entries with [`set_value`]).
    pub values: Value,
    /// `(file name, source)` of every file in `templates/`.
    pub templates: Vec<(String, String)>,
}

impl Chart {
    /// Loads the chart in `dir`.
    pub fn load(dir: &Path) -> Chart {
        let read = |p: PathBuf| std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        let meta = serde_yaml_ng::from_str(&read(dir.join("Chart.yaml"))).expect("Chart.yaml parses");
        let values = serde_yaml_ng::from_str(&read(dir.join("values.yaml"))).expect("values.yaml parses");
        let mut templates: Vec<(String, String)> = std::fs::read_dir(dir.join("templates"))
            .expect("templates/")
            .map(|e| e.expect("dir entry").path())
            .filter(|p| p.is_file())
            .map(|p| (p.file_name().expect("name").to_string_lossy().into_owned(), read(p.clone())))
            .collect();
        templates.sort();
        Chart { dir: dir.to_path_buf(), meta, values, templates }
    }

    /// The oldest Kubernetes version `Chart.yaml`'s `kubeVersion` (`>=X.Y.Z-0`) admits.
    pub fn min_kube_version(&self) -> String {
        let kv = self.meta["kubeVersion"].as_str().expect("Chart.yaml: kubeVersion");
        let v = kv.strip_prefix(">=").unwrap_or_else(|| panic!("kubeVersion `{kv}`: expected >=X.Y.Z-0"));
        v.trim().trim_end_matches("-0").to_string()
    }
}

/// Sets `path` (dotted, e.g. `router.grpcPort`) in `values`; the path must exist, so a
/// test cannot override a value the chart does not have.
pub fn set_value(values: &mut Value, path: &str, v: impl Into<Value>) {
    let mut cur = values;
    for key in path.split('.') {
        cur = cur.get_mut(key).unwrap_or_else(|| panic!("values.yaml has no `{path}`"));
    }
    *cur = v.into();
}

/// A values variant: a name and the values it sets on top of `values.yaml`. These are
/// the switches `docs/deploy.md` documents ("Checked values variants"); every one is
/// rendered by Helm and validated against the Kubernetes schemas.
#[derive(Debug, Clone)]
pub struct Variant {
    /// Its name, as `docs/deploy.md` lists it.
    pub name: &'static str,
    /// `(dotted path, YAML value)` pairs.
    pub set: &'static [(&'static str, &'static str)],
}

impl Variant {
    /// `chart` with this variant's values set.
    pub fn apply(&self, chart: &Chart) -> Chart {
        let mut c = chart.clone();
        for (path, yaml) in self.set {
            let v: Value = serde_yaml_ng::from_str(yaml).unwrap_or_else(|e| panic!("{}: {path}: {e}", self.name));
            set_value(&mut c.values, path, v);
        }
        c
    }
}

/// Every documented variant, the defaults first.
pub const VARIANTS: &[Variant] = &[
    Variant { name: "defaults", set: &[] },
    Variant {
        name: "install-example",
        set: &[("image.repository", "registry.example.com/mlaserve"), ("worker.tpSize", "8"), ("worker.groups", "2")],
    },
    Variant {
        name: "external-etcd",
        set: &[("etcd.enabled", "false"), ("etcd.externalEndpoints", "etcd-0.etcd:2379,etcd-1.etcd:2379")],
    },
    Variant {
        name: "model-pvc",
        set: &[
            ("model.persistentVolumeClaim.enabled", "true"),
            ("model.persistentVolumeClaim.claimName", "deepseek-v3"),
            ("model.path", "/models/deepseek-v3"),
        ],
    },
    Variant { name: "cpu-only", set: &[("worker.gpuResource", "\"\""), ("worker.tpSize", "1")] },
    Variant {
        name: "secured",
        set: &[
            ("security.apiKeys.secretName", "mlaserve-api-keys"),
            ("security.tls.enabled", "true"),
            ("security.tls.secretName", "mlaserve-tls"),
        ],
    },
    Variant {
        name: "service-monitor",
        set: &[("serviceMonitor.enabled", "true"), ("serviceMonitor.labels", "{release: prometheus}")],
    },
    Variant {
        name: "cluster-ip",
        set: &[
            ("router.service.type", "ClusterIP"),
            ("router.service.annotations", "{networking.gke.io/load-balancer-type: Internal}"),
        ],
    },
    Variant {
        name: "placement",
        set: &[
            ("imagePullSecrets", "[{name: regcred}]"),
            ("router.nodeSelector", "{pool: cpu}"),
            ("router.tolerations", "[{key: dedicated, operator: Equal, value: router, effect: NoSchedule}]"),
            ("worker.nodeSelector", "{nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3}"),
        ],
    },
];
