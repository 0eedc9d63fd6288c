//! A renderer for the subset of Helm's Go templates that `helm/mlaserve` uses, so the
//! tests can see the manifests without a `helm` binary.
//!
//! Supported: `{{ }}` actions with `{{-`/`-}}` whitespace trimming and `{{/* */}}`
//! comments; `.Values.…`, `.Release.{Name,Namespace,Service}`, `.Chart.{Name,Version,
//! AppVersion}` and `.`; string and integer literals; pipelines (`a | f b`); `if`/`else`/
//! `end`; `define`/`include` (with `.` as the context); the functions `quote`, `int`,
//! `toYaml`, `indent`, `nindent`, `not`, `eq` and `default`. Anything else is an error,
//! never a silent guess: a chart that needs more must grow this renderer first.
//!
//! Numbers print as Helm prints them: values reach templates as float64, so an integer
//! of a million or more prints in exponent form (`4.194304e+06`) unless piped through
//! `int` — the renderer reproduces that so a test catches it.

use serde_yaml_ng::{Mapping, Value};
use std::collections::HashMap;

/// One parsed template node.
#[derive(Debug, Clone)]
enum Node {
    Text(String),
    Expr(String),
    If { cond: String, then: Vec<Node>, otherwise: Vec<Node> },
}

/// A raw piece of template source after trimming.
#[derive(Debug)]
enum Piece {
    Text(String),
    Action(String),
}

/// Splits `src` into text and actions, applying `{{-`/`-}}` trimming and dropping comments.
fn lex(src: &str) -> Result<Vec<Piece>, String> {
    let mut out = Vec::new();
    let mut rest = src;
    let mut trim_next = false;
    while let Some(start) = rest.find("{{") {
        let mut text = rest[..start].to_string();
        if trim_next {
            text = text.trim_start().to_string();
        }
        let after = &rest[start + 2..];
        let end = after.find("}}").ok_or_else(|| format!("unclosed action near {:?}", &rest[start..]))?;
        let mut body = &after[..end];
        if let Some(b) = body.strip_prefix('-') {
            if b.starts_with([' ', '\n', '\t']) {
                text = text.trim_end().to_string();
                body = b;
            }
        }
        trim_next = false;
        if let Some(b) = body.strip_suffix('-') {
            if b.ends_with([' ', '\n', '\t']) {
                trim_next = true;
                body = b;
            }
        }
        out.push(Piece::Text(text));
        let body = body.trim();
        if !(body.starts_with("/*") && body.ends_with("*/")) {
            out.push(Piece::Action(body.to_string()));
        }
        rest = &after[end + 2..];
    }
    let mut text = rest.to_string();
    if trim_next {
        text = text.trim_start().to_string();
    }
    out.push(Piece::Text(text));
    Ok(out)
}

/// Builds the node tree; `define` blocks go to `defines`.
fn parse(pieces: Vec<Piece>, defines: &mut HashMap<String, Vec<Node>>) -> Result<Vec<Node>, String> {
    // An open `if` or `define` (or the root) and the nodes collected so far.
    struct Frame {
        kind: &'static str,
        header: String,
        then: Vec<Node>,
        otherwise: Vec<Node>,
        in_else: bool,
    }
    let mut stack =
        vec![Frame { kind: "root", header: String::new(), then: vec![], otherwise: vec![], in_else: false }];
    for p in pieces {
        let top = stack.last_mut().expect("the root frame stays");
        let push = |f: &mut Frame, n: Node| if f.in_else { f.otherwise.push(n) } else { f.then.push(n) };
        match p {
            Piece::Text(t) if t.is_empty() => {}
            Piece::Text(t) => push(top, Node::Text(t)),
            Piece::Action(a) => {
                let (word, rest) = a.split_once(char::is_whitespace).unwrap_or((a.as_str(), ""));
                match word {
                    "if" => stack.push(Frame {
                        kind: "if",
                        header: rest.trim().into(),
                        then: vec![],
                        otherwise: vec![],
                        in_else: false,
                    }),
                    "define" => stack.push(Frame {
                        kind: "define",
                        header: unquote(rest.trim())?,
                        then: vec![],
                        otherwise: vec![],
                        in_else: false,
                    }),
                    "else" if rest.trim().is_empty() => {
                        if top.kind != "if" || top.in_else {
                            return Err("`else` outside `if`".into());
                        }
                        top.in_else = true;
                    }
                    "end" => {
                        let f = stack.pop().expect("non-empty");
                        let parent = stack.last_mut().ok_or("`end` without an open block")?;
                        match f.kind {
                            "if" => push(parent, Node::If { cond: f.header, then: f.then, otherwise: f.otherwise }),
                            "define" => {
                                defines.insert(f.header, f.then);
                            }
                            _ => return Err("`end` without an open block".into()),
                        }
                    }
                    "else" | "range" | "with" | "template" | "block" | "break" | "continue" => {
                        return Err(format!("unsupported action `{a}` (extend tests/common/render.rs first)"))
                    }
                    _ => push(top, Node::Expr(a)),
                }
            }
        }
    }
    if stack.len() != 1 {
        return Err(format!("unclosed `{}` block", stack.last().map(|f| f.kind).unwrap_or("?")));
    }
    Ok(stack.pop().expect("root").then)
}

fn unquote(s: &str) -> Result<String, String> {
    let inner =
        s.strip_prefix('"').and_then(|s| s.strip_suffix('"')).ok_or_else(|| format!("expected a string: {s}"))?;
    Ok(inner.replace("\\\"", "\"").replace("\\n", "\n").replace("\\\\", "\\"))
}

/// Splits an expression into words, keeping string literals whole.
fn words(s: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' => {
                cur.push(c);
                loop {
                    let d = chars.next().ok_or_else(|| format!("unterminated string in `{s}`"))?;
                    cur.push(d);
                    if d == '\\' {
                        cur.push(chars.next().ok_or("dangling escape")?);
                    } else if d == '"' {
                        break;
                    }
                }
            }
            '|' => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
                out.push("|".into());
            }
            '(' | ')' => return Err(format!("parentheses are not supported: `{s}`")),
            c if c.is_whitespace() => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
            }
            c => cur.push(c),
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    Ok(out)
}

/// The chart: its metadata, values and templates, ready to render.
#[derive(Debug, Clone)]
pub struct Chart {
    /// `Chart.yaml`.
    pub meta: Value,
    /// `values.yaml` (tests override entries with [`set_value`]).
    pub values: Value,
    /// `(file name, source)` of every file in `templates/`.
    pub templates: Vec<(String, String)>,
}

impl Chart {
    /// Loads `dir` (a chart directory).
    pub fn load(dir: &std::path::Path) -> Chart {
        let read =
            |p: std::path::PathBuf| std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        let meta = serde_yaml_ng::from_str(&read(dir.join("Chart.yaml"))).expect("Chart.yaml parses");
        let values = serde_yaml_ng::from_str(&read(dir.join("values.yaml"))).expect("values.yaml parses");
        let mut templates: Vec<(String, String)> = std::fs::read_dir(dir.join("templates"))
            .expect("templates/")
            .map(|e| e.expect("dir entry").path())
            .filter(|p| p.is_file())
            .map(|p| (p.file_name().expect("name").to_string_lossy().into_owned(), read(p.clone())))
            .collect();
        templates.sort();
        Chart { meta, values, templates }
    }

    /// Renders every manifest template (`*.yaml`; not helpers or NOTES.txt) as release
    /// `release`; returns `(file name, rendered text)`.
    pub fn render(&self, release: &str) -> Result<Vec<(String, String)>, String> {
        let mut defines = HashMap::new();
        let mut parsed = Vec::new();
        for (name, src) in &self.templates {
            let nodes = parse(lex(src).map_err(|e| format!("{name}: {e}"))?, &mut defines)
                .map_err(|e| format!("{name}: {e}"))?;
            parsed.push((name.clone(), nodes));
        }
        let root = self.context(release);
        let r = Renderer { defines: &defines, root: &root };
        let mut out = Vec::new();
        for (name, nodes) in &parsed {
            let text = r.nodes(nodes).map_err(|e| format!("{name}: {e}"))?;
            if name.ends_with(".yaml") || name.ends_with(".yml") {
                out.push((name.clone(), text));
            }
        }
        Ok(out)
    }

    /// Renders and parses every manifest: the non-empty YAML documents, in file order.
    pub fn manifests(&self, release: &str) -> Result<Vec<Value>, String> {
        let mut docs = Vec::new();
        for (name, text) in self.render(release)? {
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

    fn context(&self, release: &str) -> Value {
        let mut chart = Mapping::new();
        for (key, field) in [("name", "Name"), ("version", "Version"), ("appVersion", "AppVersion")] {
            chart.insert(field.into(), self.meta.get(key).cloned().unwrap_or(Value::Null));
        }
        let mut rel = Mapping::new();
        rel.insert("Name".into(), release.into());
        rel.insert("Namespace".into(), "default".into());
        rel.insert("Service".into(), "Helm".into());
        let mut root = Mapping::new();
        root.insert("Values".into(), self.values.clone());
        root.insert("Chart".into(), Value::Mapping(chart));
        root.insert("Release".into(), Value::Mapping(rel));
        Value::Mapping(root)
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

/// What a template expression evaluates to.
#[derive(Debug, Clone)]
enum Val {
    Data(Value),
    /// The result of `int`: prints as a plain integer.
    Int(i64),
    Str(String),
}

impl Val {
    fn truthy(&self) -> bool {
        match self {
            Val::Int(i) => *i != 0,
            Val::Str(s) => !s.is_empty(),
            Val::Data(v) => match v {
                Value::Null => false,
                Value::Bool(b) => *b,
                Value::Number(n) => n.as_f64() != Some(0.0),
                Value::String(s) => !s.is_empty(),
                Value::Sequence(s) => !s.is_empty(),
                Value::Mapping(m) => !m.is_empty(),
                Value::Tagged(_) => true,
            },
        }
    }

    fn print(&self) -> Result<String, String> {
        match self {
            Val::Int(i) => Ok(i.to_string()),
            Val::Str(s) => Ok(s.clone()),
            Val::Data(v) => match v {
                Value::Null => Err("printing a null value (a missing or empty value?)".into()),
                Value::Bool(b) => Ok(b.to_string()),
                Value::Number(n) => Ok(go_float(n.as_f64().ok_or("number out of range")?)),
                Value::String(s) => Ok(s.clone()),
                other => Err(format!("printing a collection ({other:?}) needs toYaml")),
            },
        }
    }
}

/// Go's `%v` of a float64 (what Helm prints for any number from values.yaml).
fn go_float(f: f64) -> String {
    if f.fract() == 0.0 && f.abs() < 1e6 {
        return format!("{}", f as i64);
    }
    if f.fract() == 0.0 || f.abs() >= 1e21 {
        // Shortest %e form: 4.194304e+06.
        let s = format!("{f:e}"); // e.g. 4.194304e6
        let (m, e) = s.split_once('e').expect("exponent");
        let e: i32 = e.parse().expect("exponent digits");
        return format!("{m}e{}{:02}", if e < 0 { '-' } else { '+' }, e.abs());
    }
    format!("{f}")
}

struct Renderer<'a> {
    defines: &'a HashMap<String, Vec<Node>>,
    root: &'a Value,
}

impl Renderer<'_> {
    fn nodes(&self, nodes: &[Node]) -> Result<String, String> {
        let mut out = String::new();
        for n in nodes {
            match n {
                Node::Text(t) => out += t,
                Node::Expr(e) => out += &self.eval(e)?.print().map_err(|m| format!("`{{{{ {e} }}}}`: {m}"))?,
                Node::If { cond, then, otherwise } => {
                    let branch = if self.eval(cond)?.truthy() { then } else { otherwise };
                    out += &self.nodes(branch)?;
                }
            }
        }
        Ok(out)
    }

    fn eval(&self, expr: &str) -> Result<Val, String> {
        let w = words(expr)?;
        let mut acc: Option<Val> = None;
        for cmd in w.split(|x| x == "|") {
            if cmd.is_empty() {
                return Err(format!("empty command in `{expr}`"));
            }
            acc = Some(self.command(cmd, acc).map_err(|e| format!("`{expr}`: {e}"))?);
        }
        acc.ok_or_else(|| format!("empty expression `{expr}`"))
    }

    fn arg(&self, w: &str) -> Result<Val, String> {
        if w == "." {
            return Ok(Val::Data(self.root.clone()));
        }
        if let Some(path) = w.strip_prefix('.') {
            let mut cur = self.root;
            for key in path.split('.') {
                cur = cur.get(key).ok_or_else(|| format!("`{w}` does not exist"))?;
            }
            return Ok(Val::Data(cur.clone()));
        }
        if w.starts_with('"') {
            return Ok(Val::Str(unquote(w)?));
        }
        if let Ok(i) = w.parse::<i64>() {
            return Ok(Val::Int(i));
        }
        match w {
            "true" => Ok(Val::Data(Value::Bool(true))),
            "false" => Ok(Val::Data(Value::Bool(false))),
            _ => Err(format!("unknown word `{w}`")),
        }
    }

    fn command(&self, cmd: &[String], piped: Option<Val>) -> Result<Val, String> {
        let head = cmd[0].as_str();
        let is_fn = head.chars().next().is_some_and(|c| c.is_ascii_alphabetic()) && !matches!(head, "true" | "false");
        if !is_fn {
            if cmd.len() != 1 || piped.is_some() {
                return Err(format!("`{}` is not a function", cmd.join(" ")));
            }
            return self.arg(head);
        }
        let mut args = cmd[1..].iter().map(|a| self.arg(a)).collect::<Result<Vec<_>, _>>()?;
        args.extend(piped);
        let n = |k: usize| -> Result<(), String> {
            if args.len() == k {
                Ok(())
            } else {
                Err(format!("`{head}` takes {k} arguments, got {}", args.len()))
            }
        };
        let as_int = |v: &Val| -> Result<usize, String> {
            match v {
                Val::Int(i) => usize::try_from(*i).map_err(|e| e.to_string()),
                other => Err(format!("expected an integer, got {other:?}")),
            }
        };
        match head {
            "quote" => {
                n(1)?;
                let s = args[0].print()?;
                Ok(Val::Str(format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))))
            }
            "int" => {
                n(1)?;
                match &args[0] {
                    Val::Int(i) => Ok(Val::Int(*i)),
                    Val::Data(Value::Number(x)) => Ok(Val::Int(x.as_f64().ok_or("number")? as i64)),
                    Val::Data(Value::String(s)) | Val::Str(s) => Ok(Val::Int(s.parse().unwrap_or(0))),
                    other => Err(format!("int of {other:?}")),
                }
            }
            "toYaml" => {
                n(1)?;
                let v = match &args[0] {
                    Val::Data(v) => v.clone(),
                    Val::Int(i) => Value::from(*i),
                    Val::Str(s) => Value::from(s.clone()),
                };
                let s = serde_yaml_ng::to_string(&v).map_err(|e| e.to_string())?;
                Ok(Val::Str(s.trim_end_matches('\n').to_string()))
            }
            "indent" | "nindent" => {
                n(2)?;
                let pad = " ".repeat(as_int(&args[0])?);
                let s = args[1].print()?;
                let body = format!("{pad}{}", s.replace('\n', &format!("\n{pad}")));
                Ok(Val::Str(if head == "nindent" { format!("\n{body}") } else { body }))
            }
            "include" => {
                n(2)?;
                let Val::Str(name) = &args[0] else { return Err("include needs a template name".into()) };
                if cmd.get(2).map(String::as_str) != Some(".") {
                    return Err("include is supported with `.` as the context only".into());
                }
                let body = self.defines.get(name).ok_or_else(|| format!("no template `{name}`"))?;
                Ok(Val::Str(self.nodes(body)?))
            }
            "not" => {
                n(1)?;
                Ok(Val::Data(Value::Bool(!args[0].truthy())))
            }
            "eq" => {
                n(2)?;
                Ok(Val::Data(Value::Bool(args[0].print()? == args[1].print()?)))
            }
            "default" => {
                n(2)?;
                Ok(if args[1].truthy() { args[1].clone() } else { args[0].clone() })
            }
            other => Err(format!("unsupported function `{other}` (extend tests/common/render.rs first)")),
        }
    }
}
