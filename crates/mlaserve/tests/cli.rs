//! The command line as a user meets it: errors are one line naming the flag or file (no
//! debug dump, no backtrace), and every flag of every subcommand says what it does.

use std::process::{Command, Output};

fn mlaserve(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mlaserve"))
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .env("RUST_LOG", "off")
        .output()
        .expect("the binary runs")
}

/// The one line of stderr a failed command printed.
fn error_line(out: &Output) -> String {
    assert!(!out.status.success(), "expected a failure");
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line expected:\n{err}");
    assert!(!err.contains("acktrace") && !err.contains("Caused by"), "{err}");
    lines[0].to_string()
}

#[test]
fn a_missing_model_is_one_line_naming_the_flag_and_the_path() {
    let e = error_line(&mlaserve(&["serve", "--model", "/nonexistent/model-dir"]));
    assert!(e.starts_with("error: --model /nonexistent/model-dir"), "{e}");
    assert!(e.contains("working directory"), "{e}");
    let e = error_line(&mlaserve(&["worker", "--model", "/nonexistent/model-dir", "--backend", "cpu"]));
    assert!(e.contains("/nonexistent/model-dir/config.json"), "{e}");
}

#[test]
fn client_errors_are_said_once() {
    let e = error_line(&mlaserve(&["generate", "--addr", "127.0.0.1:1", "--prompt", "hi"]));
    assert!(e.starts_with("error: cannot connect to http://127.0.0.1:1"), "{e}");
    assert_eq!(e.matches("127.0.0.1:1").count(), 1, "{e}");
}

#[test]
fn generate_takes_text_or_token_ids() {
    let both = mlaserve(&["generate", "--prompt", "x", "--prompt-ids", "1,2"]);
    assert!(!both.status.success());
    assert!(String::from_utf8_lossy(&both.stderr).contains("cannot be used with"));
    let neither = mlaserve(&["generate"]);
    assert!(!neither.status.success());
}

#[test]
fn every_flag_says_what_it_does() {
    let commands: &[&[&str]] = &[
        &["serve"],
        &["router"],
        &["worker"],
        &["generate"],
        &["gen-model"],
        &["bench", "serve"],
        &["bench", "engine"],
        &["bench", "acceptance"],
    ];
    for cmd in commands {
        let out = mlaserve(&[*cmd, &["--help"][..]].concat());
        assert!(out.status.success(), "{cmd:?} --help");
        let help = String::from_utf8_lossy(&out.stdout).into_owned();
        let lines: Vec<&str> = help.lines().collect();
        for (i, l) in lines.iter().enumerate() {
            let t = l.trim_start();
            let is_flag = t.starts_with("--") || (t.starts_with('-') && t.get(2..4) == Some(", "));
            if !is_flag || l.len() - t.len() > 6 {
                continue;
            }
            // The description follows on the same line after two spaces, or (when clap
            // chooses the long layout) on the next, deeper-indented line.
            let same_line = t.split_once("  ").is_some_and(|(_, rest)| !rest.trim().is_empty());
            let next = lines.get(i + 1).copied().unwrap_or("");
            let next_line = next.len() - next.trim_start().len() > l.len() - t.len() && !next.trim().is_empty();
            let described = same_line || next_line;
            assert!(described, "`mlaserve {}`: flag without a description: {t}", cmd.join(" "));
        }
    }
}

#[test]
fn gen_model_writes_fp8_shards_and_refuses_bad_flags() {
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("gen-model-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let o = out.to_str().expect("utf-8 path");
    let run =
        mlaserve(&["gen-model", "--preset", "tiny-v3", "--fp8", "--layers", "2", "--shard-size-mb", "1", "--out", o]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).expect("config")).expect("json");
    assert_eq!(cfg["quantization_config"]["quant_method"], "fp8");
    assert_eq!(cfg["num_hidden_layers"], 2);
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("model.safetensors.index.json")).expect("index"))
            .expect("json");
    // The tiny model fits one 1 MiB shard.
    let scale = "model.layers.1.mlp.experts.0.up_proj.weight_scale_inv";
    assert_eq!(index["weight_map"][scale], "model-00001-of-00001.safetensors");
    assert!(index["metadata"]["total_size"].as_u64().is_some_and(|n| n > 0));
    let e = error_line(&mlaserve(&["gen-model", "--preset", "tiny-v9", "--out", o]));
    assert!(e.contains("--preset tiny-v9") && e.contains("deepseek-v3"), "{e}");
    let zero = mlaserve(&["gen-model", "--preset", "tiny-v3", "--layers", "0", "--out", o]);
    assert!(!zero.status.success());
    assert!(String::from_utf8_lossy(&zero.stderr).contains("'--layers <LAYERS>': 0 is not in 1..=1000"));
    std::fs::remove_dir_all(&out).expect("clean up");
}
