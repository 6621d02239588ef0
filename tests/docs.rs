//! The documentation names only what exists: every `torus-wgpu <command> ... --flag` in a shell
//! block of README.md and docs/*.md (continuation lines included) names a command the CLI has
//! and flags that command's `--help` lists; every route they name (`POST /v1/messages`,
//! `/api/ps`) is one the server has (it answers with something other than its no-such-route
//! 404); every relative link of those pages points at a file of the repository; and no page
//! points outside the repository.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every page of docs/.
fn pages() -> Vec<PathBuf> {
    let mut out = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    out.extend(docs);
    out
}

/// The torus-wgpu command lines of a page's fenced blocks (a line ending in `\` joined with the
/// next), without the program's name: `serve --model X ...`.
fn command_lines(text: &str) -> Vec<String> {
    let (mut out, mut fenced, mut pending): (Vec<String>, bool, Option<String>) = (Vec::new(), false, None);
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            pending = None;
            continue;
        }
        if !fenced {
            continue;
        }
        let line = line.trim();
        let joined = match pending.take() {
            Some(p) => format!("{p} {line}"),
            None => {
                let Some(rest) =
                    line.strip_prefix("torus-wgpu ").or_else(|| line.strip_prefix("cargo run --release -- "))
                else {
                    continue;
                };
                rest.to_string()
            }
        };
        match joined.strip_suffix('\\') {
            Some(head) => pending = Some(head.trim_end().to_string()),
            None => out.push(joined),
        }
    }
    out
}

/// The `--flags` of a command line (up to a comment), without values or brackets.
fn flags(line: &str) -> Vec<String> {
    let line = line.split(" #").next().unwrap_or(line);
    line.split_whitespace()
        .filter_map(|w| {
            let w = w.trim_start_matches(['[', '(']);
            let w = w.strip_prefix("--")?;
            let name: String = w.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '-').collect();
            (!name.is_empty()).then(|| format!("--{name}"))
        })
        .collect()
}

fn help(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_torus-wgpu")).args(args).output().unwrap();
    assert!(out.status.success(), "torus-wgpu {args:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).to_string()
}

/// Whether `help` lists `flag` as a whole word.
fn lists(help: &str, flag: &str) -> bool {
    help.match_indices(flag)
        .any(|(i, _)| !help[i + flag.len()..].chars().next().is_some_and(|c| c.is_ascii_alphanumeric() || c == '-'))
}

#[test]
fn documented_commands_and_flags_exist() {
    let mut wanted: BTreeMap<String, BTreeSet<(String, String)>> = BTreeMap::new();
    let mut lines = 0;
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let name = page.strip_prefix(root()).unwrap().display().to_string();
        for line in command_lines(&text) {
            lines += 1;
            let command = line.split_whitespace().next().unwrap_or("").to_string();
            let entry = wanted.entry(command).or_default();
            entry.insert((name.clone(), String::new()));
            for f in flags(&line) {
                entry.insert((name.clone(), f));
            }
        }
    }
    assert!(lines >= 20 && wanted.contains_key("serve"), "only {lines} command lines found in the docs");
    let mut bad = Vec::new();
    for (command, uses) in &wanted {
        let out = Command::new(env!("CARGO_BIN_EXE_torus-wgpu")).args([command.as_str(), "--help"]).output().unwrap();
        if !out.status.success() {
            let pages: BTreeSet<&String> = uses.iter().map(|(p, _)| p).collect();
            bad.push(format!("`torus-wgpu {command}` is no command (named in {pages:?})"));
            continue;
        }
        let text = String::from_utf8_lossy(&out.stdout);
        // `--help` and `--version` are clap's own.
        for (page, flag) in uses.iter().filter(|(_, f)| !f.is_empty() && f != "--help" && f != "--version") {
            if !lists(&text, flag) {
                bad.push(format!("{page}: `torus-wgpu {command} {flag}`: not a flag of {command}"));
            }
        }
    }
    assert!(bad.is_empty(), "the docs name what the CLI does not have:\n{}", bad.join("\n"));
}

#[test]
fn the_checks_can_fail() {
    let text =
        "```sh\ntorus-wgpu serve --model m.gguf \\\n    [--no-such-flag 3] # --commented\n```\ntorus-wgpu prose --x\n";
    assert_eq!(command_lines(text), ["serve --model m.gguf [--no-such-flag 3] # --commented"]);
    assert_eq!(flags(&command_lines(text)[0]), ["--model", "--no-such-flag"]);
    let serve = help(&["serve", "--help"]);
    assert!(lists(&serve, "--model") && !lists(&serve, "--no-such-flag") && !lists(&serve, "--mod"));
}

#[test]
fn links_stay_inside_the_repository() {
    let mut bad = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let dir = page.parent().unwrap();
        let name = page.strip_prefix(root()).unwrap().display().to_string();
        for (i, _) in text.match_indices("](") {
            let target: String = text[i + 2..].chars().take_while(|&c| c != ')').collect();
            let path = target.split('#').next().unwrap_or("");
            if path.is_empty() || path.contains("://") || path.starts_with("mailto:") {
                continue;
            }
            let file = dir.join(path);
            let inside = file.canonicalize().map(|f| f.starts_with(root().canonicalize().unwrap()));
            match inside {
                Ok(true) => {}
                Ok(false) => bad.push(format!("{name}: {target} is outside the repository")),
                Err(_) => bad.push(format!("{name}: {target} does not exist")),
            }
        }
        if text.contains("../shared") {
            bad.push(format!("{name}: names ../shared"));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
    assert!(Path::new(&root().join("docs/architecture.md")).exists());
}

/// The routes a text names: `METHOD /path`, or a backticked path under /v1/, /api/ or one of
/// the top-level routes (method unknown: None). Placeholders (`{id}`) become `x`.
fn routes(text: &str) -> BTreeSet<(Option<String>, String)> {
    let path_char = |c: char| c.is_ascii_alphanumeric() || "/_-.{}:".contains(c);
    let clean = |p: &str| -> String {
        let p = p.trim_end_matches(['.', ':', ',']);
        let mut out = String::new();
        let mut skip = false;
        for c in p.chars() {
            match c {
                '{' => {
                    skip = true;
                    out.push('x');
                }
                '}' => skip = false,
                _ if !skip => out.push(c),
                _ => {}
            }
        }
        out
    };
    let mut out = BTreeSet::new();
    for method in ["GET", "POST", "DELETE"] {
        for (i, m) in text.match_indices(&format!("{method} /")) {
            let path: String = text[i + m.len() - 1..].chars().take_while(|&c| path_char(c)).collect();
            out.insert((Some(method.to_string()), clean(&path)));
        }
    }
    let top = [
        "/health",
        "/metrics",
        "/version",
        "/props",
        "/slots",
        "/tokenize",
        "/detokenize",
        "/completion",
        "/infill",
        "/apply-template",
        "/server_info",
    ];
    for (i, _) in text.match_indices("`/") {
        let path: String = text[i + 1..].chars().take_while(|&c| path_char(c)).collect();
        if !text[i + 1 + path.len()..].starts_with('`') || path.contains("...") {
            continue;
        }
        let under = (path.starts_with("/v1/") || path.starts_with("/api/")) && path.len() > 5;
        if under || top.contains(&path.as_str()) {
            out.insert((None, clean(&path)));
        }
    }
    out
}

/// One HTTP/1.1 exchange: (status, body).
fn http(addr: &str, method: &str, path: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(std::time::Duration::from_secs(120))).unwrap();
    let body = if method == "GET" { "" } else { "{}" };
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).to_string();
    let status = text.split_whitespace().nth(1).and_then(|x| x.parse().ok()).unwrap_or(0);
    (status, text)
}

#[test]
fn documented_routes_exist() {
    let mut wanted: BTreeMap<(Option<String>, String), BTreeSet<String>> = BTreeMap::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        let name = page.strip_prefix(root()).unwrap().display().to_string();
        for r in routes(&text) {
            wanted.entry(r).or_default().insert(name.clone());
        }
    }
    assert!(wanted.len() >= 20, "only {} routes found in the docs", wanted.len());
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_torus-wgpu"));
    cmd.env_remove("RUST_LOG").args(["serve", "--port", "0", "--model"]).arg(common::smollm2());
    let (mut child, log, _lines) =
        common::spawn_until_ready(&mut cmd, "serve", "ready on http://", std::time::Duration::from_secs(180));
    let addr =
        log.last().unwrap().split("ready on http://").nth(1).unwrap().split_whitespace().next().unwrap().to_string();
    // The server's answer to a route it does not have, to tell it from a route's own 404.
    let (_, none) = http(&addr, "GET", "/v1/no-such-route");
    assert!(none.contains("no such route"), "{none}");
    let mut bad = Vec::new();
    for ((method, path), pages) in &wanted {
        let methods: Vec<&str> = match method {
            Some(m) => vec![m.as_str()],
            None => vec!["GET", "POST"],
        };
        let answers: Vec<(u16, String)> = methods.iter().map(|m| http(&addr, m, path)).collect();
        if answers.iter().all(|(status, body)| *status == 0 || body.contains("no such route")) {
            bad.push(format!("{} {path} (named in {pages:?})", method.as_deref().unwrap_or("GET/POST")));
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(bad.is_empty(), "the docs name routes the server does not have:\n{}", bad.join("\n"));
}

#[test]
fn route_extraction_finds_methods_and_backticked_paths() {
    let r = routes("Send `POST /v1/messages`, then `/v1/responses/{id}` or `/api/ps`; not `/v1/...` nor /etc/x.");
    let want: BTreeSet<(Option<String>, String)> = [
        (Some("POST".to_string()), "/v1/messages".to_string()),
        (None, "/v1/responses/x".to_string()),
        (None, "/api/ps".to_string()),
    ]
    .into_iter()
    .collect();
    assert_eq!(r, want);
}
