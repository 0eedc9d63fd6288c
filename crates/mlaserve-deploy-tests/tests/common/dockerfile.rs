//! A reader for `deploy/docker/Dockerfile`: its instructions per build stage and what
//! its build arguments default to, so tests can check what the default image builds.
//! It knows the subset of Dockerfile syntax the file uses (line continuations,
//! comments, `ARG` with defaults before and after `FROM`, `FROM ... AS name`) and
//! substitutes `${NAME}` / `$NAME` in `FROM` lines.

use std::collections::BTreeMap;

/// One instruction: its keyword (upper case) and the rest of the line, continuations
/// joined.
#[derive(Debug, Clone)]
pub struct Instr {
    pub keyword: String,
    pub args: String,
}

/// A build stage: `FROM <image> AS <name>` and its instructions.
#[derive(Debug, Clone)]
pub struct Stage {
    /// The base image with the build arguments' defaults substituted.
    pub from: String,
    pub name: String,
    pub instrs: Vec<Instr>,
}

/// The parsed Dockerfile.
#[derive(Debug, Clone)]
pub struct Dockerfile {
    /// `ARG`s before the first `FROM`, with their defaults.
    pub global_args: BTreeMap<String, String>,
    pub stages: Vec<Stage>,
}

impl Dockerfile {
    pub fn parse(text: &str) -> Dockerfile {
        let mut logical = Vec::new();
        let mut cur = String::new();
        for line in text.lines() {
            let t = line.trim();
            if cur.is_empty() && (t.is_empty() || t.starts_with('#')) {
                continue;
            }
            // A comment line inside a continued instruction is dropped, as Docker does.
            if !cur.is_empty() && t.starts_with('#') {
                continue;
            }
            match t.strip_suffix('\\') {
                Some(head) => {
                    cur += head;
                    cur.push(' ');
                }
                None => {
                    cur += t;
                    logical.push(std::mem::take(&mut cur));
                }
            }
        }
        let mut df = Dockerfile { global_args: BTreeMap::new(), stages: Vec::new() };
        for l in logical {
            let (kw, args) = l.split_once(char::is_whitespace).unwrap_or((&l, ""));
            let (kw, args) = (kw.to_ascii_uppercase(), args.trim().to_string());
            if kw == "FROM" {
                let mut words = args.split_whitespace();
                let image = substitute(words.next().expect("FROM image"), &df.global_args);
                let name = match (words.next(), words.next()) {
                    (Some(a), Some(n)) if a.eq_ignore_ascii_case("as") => n.to_string(),
                    _ => df.stages.len().to_string(),
                };
                df.stages.push(Stage { from: image, name, instrs: Vec::new() });
            } else if let Some(stage) = df.stages.last_mut() {
                stage.instrs.push(Instr { keyword: kw, args });
            } else if kw == "ARG" {
                let (k, v) = args.split_once('=').unwrap_or((&args, ""));
                df.global_args.insert(k.trim().to_string(), v.trim().to_string());
            }
        }
        df
    }

    /// The stage named `name`.
    pub fn stage(&self, name: &str) -> &Stage {
        self.stages.iter().find(|s| s.name == name).unwrap_or_else(|| panic!("Dockerfile has no stage `{name}`"))
    }
}

impl Stage {
    /// The default of build argument `name` in this stage: its own `ARG name=default`,
    /// else the global default an `ARG name` in the stage brings in; `None` when the
    /// stage does not declare it.
    pub fn arg_default(&self, name: &str, global: &BTreeMap<String, String>) -> Option<String> {
        self.instrs.iter().filter(|i| i.keyword == "ARG").find_map(|i| {
            let (k, v) = i.args.split_once('=').map(|(k, v)| (k, Some(v))).unwrap_or((i.args.as_str(), None));
            (k.trim() == name).then(|| match v {
                Some(v) => v.trim().trim_matches('"').to_string(),
                None => global.get(name).cloned().unwrap_or_default(),
            })
        })
    }

    /// The arguments of every `keyword` instruction, in order.
    pub fn all(&self, keyword: &str) -> Vec<&str> {
        self.instrs.iter().filter(|i| i.keyword == keyword).map(|i| i.args.as_str()).collect()
    }

    /// `ENV` settings (`K=V` pairs) of this stage, later ones winning.
    pub fn env(&self) -> BTreeMap<String, String> {
        let mut env = BTreeMap::new();
        for args in self.all("ENV") {
            for pair in args.split_whitespace() {
                if let Some((k, v)) = pair.split_once('=') {
                    env.insert(k.to_string(), v.to_string());
                }
            }
        }
        env
    }
}

/// `${NAME}` and `$NAME` replaced by `args`' values.
fn substitute(s: &str, args: &BTreeMap<String, String>) -> String {
    let mut out = s.to_string();
    for (k, v) in args {
        out = out.replace(&format!("${{{k}}}"), v).replace(&format!("${k}"), v);
    }
    out
}

/// A JSON-array (exec form) instruction's words, e.g. `ENTRYPOINT ["mlaserve"]`.
pub fn exec_form(args: &str) -> Vec<String> {
    serde_json::from_str(args).unwrap_or_else(|e| panic!("`{args}` is not in exec (JSON array) form: {e}"))
}
