//! Snapshot tests of the command line (issue 31, point 2): every command's `--help`
//! (`tests/cmd/*.trycmd`), and the ```` ```console ```` transcripts of `docs/*.md`, run
//! from the repository's root against a real nats-server and `webproxy serve`.
//!
//! `TRYCMD=overwrite cargo test -p webproxy --test cli_snapshots` rewrites the expected
//! output after a deliberate change; review the diff before committing it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use webproxy_testkit::{NATS_CLI_VARS, NatsServer, Service, ServiceOptions};

/// A command that takes longer than this has hung (a `send` waits 30 s at most, and
/// the transcripts never wait for one that long).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

/// The repository's root, where the docs' commands run (their paths are relative to it).
fn repository_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the repository root exists")
}

/// Cases with the nats CLI's variables of whoever runs the tests emptied (the commands
/// take an empty one as unset), then `NATS_URL` set to `nats_url` when given.
fn test_cases(nats_url: Option<&str>) -> trycmd::TestCases {
    let cases = trycmd::TestCases::new();
    cases.default_bin_name("webproxy").timeout(COMMAND_TIMEOUT);
    for var in NATS_CLI_VARS {
        cases.env(*var, "");
    }
    if let Some(url) = nats_url {
        cases.env("NATS_URL", url);
    }
    // Logs at the level a user sees them (the commands' default, `warn`); a developer's
    // RUST_LOG would add lines.
    cases.env("RUST_LOG", "warn");
    cases
}

/// Every command's and subcommand's `--help`, and `--version`: one file per command.
#[test]
fn help() {
    test_cases(None)
        .case(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cmd/*.trycmd"))
        .run();
}

/// The docs' `console` blocks, as a reader would type them at the repository's root
/// with `WEBPROXY_CONFIG__SOURCE=kv webproxy serve --config config/webproxy.toml`
/// running and `NATS_URL` naming its nats-server. Blocks marked `sh` are not run.
#[tokio::test(flavor = "multi_thread")]
async fn docs_examples() {
    let root = repository_root();
    let nats = NatsServer::start();
    // The address guard as the file says (it opens 127.0.0.1 alone), so the document
    // the service seeds is the file's.
    let options = ServiceOptions::guarded().env("WEBPROXY_CONFIG__SOURCE", "kv");
    let _service = Service::start_with(&nats.url(), &example_config(&root), options).await;
    // The cases' commands run in the test's directory: every case here runs from the
    // root, and `help` names its cases by absolute path, so this moves nothing of its.
    std::env::set_current_dir(&root).expect("enter the repository root");
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("read docs/")
        .map(|entry| entry.expect("a docs/ entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "md"))
        .collect();
    docs.sort();
    let misplaced: Vec<String> = docs.iter().flat_map(|doc| unrun_fences(doc)).collect();
    assert!(misplaced.is_empty(), "{}", misplaced.join("\n"));
    // One file after another, never at once: a file's transcript changes the
    // deployment (a push, a pause) that another's would read. Blocking, and the service
    // is a process of its own, so nothing of this runtime's needs to run meanwhile.
    tokio::task::block_in_place(|| {
        for doc in &docs {
            test_cases(Some(&nats.url())).case(doc).run();
        }
    });
}

/// `config/webproxy.toml` without its `[nats]` table, which the fixture writes with its
/// own server's URL.
fn example_config(root: &Path) -> String {
    let path = root.join("config/webproxy.toml");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let mut config: toml::Table =
        toml::from_str(&text).unwrap_or_else(|e| panic!("{} is not TOML: {e}", path.display()));
    config.remove("nats");
    toml::to_string(&config).expect("a TOML table serializes")
}

/// The code fences of `doc` that trycmd would misread: one without a language, which it
/// runs as a transcript, and an indented `console` one, which it skips (its fence must
/// start the line).
fn unrun_fences(doc: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(doc)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", doc.display()));
    let mut open = false;
    let mut found = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        // A fence's info string has no backtick (CommonMark): "```` ```sh ````" in
        // running text is inline code.
        let Some(info) = trimmed
            .strip_prefix("```")
            .filter(|info| !info.trim_start_matches('`').contains('`'))
        else {
            continue;
        };
        let place = format!("{}:{}", doc.display(), index + 1);
        if !open && info.trim().is_empty() {
            found.push(format!(
                "{place}: a code block without a language is run as a transcript; name its language (```text, ```sh)"
            ));
        }
        if !open && info.starts_with("console") && trimmed.len() != line.len() {
            found.push(format!(
                "{place}: an indented ```console block is not run; start its fence at the line's start, or make it ```sh"
            ));
        }
        open = !open;
    }
    found
}
