//! The model's tokenizer (`tokenizer.json` through the `tokenizers` crate) and its stop
//! ids (`generation_config.json`, else `config.json`).

use mlaserve_core::{Error, ModelConfig, Result};
use std::path::Path;

/// A loaded tokenizer plus the ids that end a generation.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    eos_token_ids: Vec<u32>,
    bos_token_id: Option<u32>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer").field("eos_token_ids", &self.eos_token_ids).finish()
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`; EOS ids from `dir/generation_config.json` when it names
    /// them, else from the config.
    pub fn from_dir(dir: &Path, config: &ModelConfig) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| Error::file(&path, e.to_string()))?;
        let mut eos_token_ids = config.eos_token_ids.clone();
        let mut bos_token_id = config.bos_token_id;
        let gen_path = dir.join("generation_config.json");
        if gen_path.exists() {
            let text = std::fs::read_to_string(&gen_path).map_err(|e| Error::file(&gen_path, e.to_string()))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| Error::file(&gen_path, format!("not valid JSON: {e}")))?;
            let ids = |v: &serde_json::Value| -> Result<Vec<u32>> {
                let one = |x: &serde_json::Value| {
                    x.as_u64()
                        .filter(|&n| (n as usize) < config.vocab_size)
                        .map(|n| n as u32)
                        .ok_or_else(|| Error::file(&gen_path, format!("bad token id {x}")))
                };
                match v {
                    serde_json::Value::Array(a) => a.iter().map(one).collect(),
                    x => Ok(vec![one(x)?]),
                }
            };
            if let Some(e) = v.get("eos_token_id").filter(|x| !x.is_null()) {
                eos_token_ids = ids(e)?;
            }
            if let Some(b) = v.get("bos_token_id").filter(|x| !x.is_null()) {
                bos_token_id = ids(b)?.first().copied();
            }
        }
        Ok(Tokenizer { inner, eos_token_ids, bos_token_id })
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// Encodes `text`, prepending BOS when `add_bos` and the model has one.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| Error::Backend(format!("tokenize: {e}")))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_bos {
            ids.extend(self.bos_token_id);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Decodes ids to text (special tokens skipped when `skip_special`).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(|e| Error::Backend(format!("detokenize: {e}")))
    }

    /// The underlying `tokenizers` object (incremental detokenization lives in the router).
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}
