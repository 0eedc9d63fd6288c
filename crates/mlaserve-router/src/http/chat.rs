//! Chat templates: the model's `tokenizer_config.json` `chat_template`, rendered with
//! minijinja (with Python's string methods, as Hugging Face templates use them), given
//! `messages`, `add_generation_prompt`, `bos_token` and `eos_token`.

use serde::Serialize;
use std::path::Path;

/// One chat message as the template sees it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// An assistant message's tool calls (OpenAI's objects, as given).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A tool message's call id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

/// A model's chat template (see the module docs).
#[derive(Debug)]
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos: String,
    eos: String,
}

/// `tokenizer_config.json`'s `bos_token` / `eos_token`: a string or `{"content": ...}`.
fn special(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).unwrap_or_default().to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// The template of the model in `dir`; `Ok(None)` when it has none; an error naming
    /// the file when the file or the template is broken.
    pub fn load(dir: &Path) -> Result<Option<ChatTemplate>, String> {
        let path = dir.join("tokenizer_config.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("{}: {e}", path.display())),
        };
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let source = match &v["chat_template"] {
            serde_json::Value::String(s) => s.clone(),
            // A list of named templates: the one named "default".
            serde_json::Value::Array(list) => {
                match list.iter().find(|t| t["name"] == "default").and_then(|t| t["template"].as_str()) {
                    Some(s) => s.to_string(),
                    None => return Ok(None),
                }
            }
            _ => return Ok(None),
        };
        Self::new(source, special(&v["bos_token"]), special(&v["eos_token"]))
            .map(Some)
            .map_err(|e| format!("{}: chat_template: {e}", path.display()))
    }

    /// A template from its source.
    pub fn new(source: String, bos: String, eos: String) -> Result<ChatTemplate, String> {
        let mut env = minijinja::Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_template_owned("chat", source).map_err(|e| e.to_string())?;
        Ok(ChatTemplate { env, bos, eos })
    }

    /// The prompt text of `messages`, ending with the assistant's turn opened when
    /// `add_generation_prompt`.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String, String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// The same, with the request's `tools` (OpenAI's list) in the template's `tools`.
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, String> {
        let t = self.env.get_template("chat").map_err(|e| e.to_string())?;
        t.render(minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos,
            eos_token => self.eos,
        })
        .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> Message {
        Message { role: role.into(), content: content.into(), ..Default::default() }
    }

    /// The bundled model's template, as shipped.
    #[test]
    fn the_bundled_models_template_renders() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/mla-tiny-code");
        let t = ChatTemplate::load(&dir).expect("loads").expect("the bundled model has a template");
        let text = t.render(&[msg("system", "Be brief."), msg("user", "def add(a, b):")], true).expect("renders");
        assert!(text.starts_with(&t.bos), "{text:?}");
        assert!(text.contains("Be brief.") && text.contains("def add(a, b):"), "{text:?}");
        let open = t.render(&[msg("user", "x")], false).expect("renders");
        assert!(text.len() > open.len());
    }

    /// DeepSeek-V3's template (as in its `tokenizer_config.json`): Python string methods,
    /// namespaces, `raise_exception`.
    #[test]
    fn deepseek_style_templates_render() {
        let src = r#"{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}{%- else %}{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}{%- endif %}{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}{%- for message in messages %}{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}{%- if message['role'] == 'assistant' and message['content'] is not none %}{% set content = message['content'] %}{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor -%}{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"#;
        let t = ChatTemplate::new(src.into(), "<s>".into(), "</s>".into()).expect("compiles");
        let text = t
            .render(
                &[msg("system", "S"), msg("user", "hi"), msg("assistant", "<think>x</think>ok"), msg("user", "again")],
                true,
            )
            .expect("renders");
        assert_eq!(text, "<s>S<｜User｜>hi<｜Assistant｜>ok<｜end▁of▁sentence｜><｜User｜>again<｜Assistant｜>");
        let bad =
            ChatTemplate::new("{{ raise_exception('roles must alternate') }}".into(), String::new(), String::new())
                .expect("compiles");
        assert!(bad.render(&[], true).unwrap_err().contains("roles must alternate"));
        // Tools reach the template, and so do an assistant's calls and a tool's result.
        let t = ChatTemplate::new(
            "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{% if m.tool_calls %}{{ m.tool_calls[0].function.name }}{% endif %}{% if m.tool_call_id %}<{{ m.tool_call_id }}:{{ m.content }}>{% endif %}{% endfor %}".into(),
            String::new(),
            String::new(),
        )
        .expect("compiles");
        let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather"}}]);
        let calls = serde_json::json!([{"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]);
        let m = [
            Message { role: "assistant".into(), tool_calls: Some(calls), ..Default::default() },
            Message {
                role: "tool".into(),
                content: "sunny".into(),
                tool_call_id: Some("c0".into()),
                ..Default::default()
            },
        ];
        assert_eq!(t.render_with_tools(&m, Some(&tools), true).expect("renders"), "[get_weather]get_weather<c0:sunny>");
    }
}
