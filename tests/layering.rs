//! The room rule (docs/architecture.md, "The rooms"), enforced on the sources: every top-level
//! module of src/ is a room with a `//!` header naming what it owns, may use and never uses; a
//! room uses (by `crate::` paths) only rooms below it and the leaves, and only rooms its header
//! says it may use; the scheduler and the block manager never see wgpu; nothing below the server
//! knows HTTP. There is no allow-list.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Rooms anyone may use.
const LEAVES: [&str; 5] = ["config", "sampling", "shutdown", "formats", "hub"];

/// Each room's level: a room may use rooms of a lower level (and the leaves).
const LEVELS: [(&str, u32); 13] = [
    ("gpu", 1),
    ("kv", 1),
    ("weights", 2),
    ("tokenizer", 2),
    ("ops", 3),
    ("structured", 3),
    ("model", 4),
    ("exec", 5),
    ("kv_events", 5),
    ("spec", 6),
    ("engine", 7),
    ("server", 8),
    ("bench", 8),
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every room with its files (lib.rs and main.rs are the crate's roots, not rooms).
fn rooms() -> BTreeMap<String, Vec<PathBuf>> {
    let mut rooms = BTreeMap::new();
    for e in std::fs::read_dir(src()).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_stem().unwrap().to_string_lossy().to_string();
        if name == "lib" || name == "main" {
            continue;
        }
        let mut files = Vec::new();
        if p.is_dir() {
            rust_files(&p, &mut files);
        } else {
            files.push(p);
        }
        rooms.insert(name, files);
    }
    rooms
}

/// The code of a file without comments (line comments, and doc comments naming other rooms).
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

/// The rooms a file names through `crate::<room>`.
fn used(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + 7..];
        let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        out.insert(name);
    }
    out
}

fn level(room: &str) -> Option<u32> {
    LEVELS.iter().find(|(r, _)| *r == room).map(|&(_, l)| l)
}

/// The header of a room: its mod.rs (or its file), the "May use:" list.
fn header_may_use(room: &str, files: &[PathBuf]) -> BTreeSet<String> {
    // The room's own mod.rs (not a sub-room's), or the room's single file.
    let own = src().join(room).join("mod.rs");
    let head = files.iter().find(|p| **p == own || p.parent() == Some(&src())).unwrap();
    let text = std::fs::read_to_string(head).unwrap();
    let lead: Vec<&str> = text.lines().take_while(|l| l.starts_with("//!")).collect();
    for key in ["//! Owns:", "//! May use:", "//! Never uses:"] {
        assert!(lead.iter().any(|l| l.starts_with(key)), "{}: the room header has no {key:?} line", head.display());
    }
    let may = lead.iter().find(|l| l.starts_with("//! May use:")).unwrap();
    let list = may.trim_start_matches("//! May use:").trim().trim_end_matches('.');
    if list == "nothing" {
        return BTreeSet::new();
    }
    let names: BTreeSet<String> = list.split(',').map(|s| s.trim().to_string()).collect();
    for n in &names {
        assert!(level(n).is_some() || LEAVES.contains(&n.as_str()), "{room}: its header names {n:?}, not a room");
    }
    names
}

#[test]
fn every_room_is_known_and_has_a_header() {
    for (room, files) in rooms() {
        assert!(level(&room).is_some() || LEAVES.contains(&room.as_str()), "src/{room} is not a room of the rule");
        header_may_use(&room, &files);
    }
}

#[test]
fn rooms_use_only_rooms_below_them_and_their_header_says_so() {
    let rooms = rooms();
    let mut broken = Vec::new();
    for (room, files) in &rooms {
        let may = header_may_use(room, files);
        for f in files {
            for u in used(&code(f)) {
                if &u == room || !rooms.contains_key(&u) {
                    continue;
                }
                let below = match (level(room), level(&u)) {
                    _ if LEAVES.contains(&u.as_str()) => !LEAVES.contains(&room.as_str()),
                    (Some(a), Some(b)) => b < a,
                    // A leaf uses no other room.
                    (None, _) => false,
                    (Some(_), None) => false,
                };
                if !below {
                    broken.push(format!("{} uses {u}, which is not below {room}", f.display()));
                }
                if !may.contains(&u) {
                    broken.push(format!("{} uses {u}, which the {room} header does not list", f.display()));
                }
            }
        }
    }
    assert!(broken.is_empty(), "the room rule is broken:\n{}", broken.join("\n"));
}

#[test]
fn the_scheduler_and_the_block_manager_never_see_wgpu() {
    let mut files = vec![src().join("engine/scheduler.rs"), src().join("engine/sequence.rs")];
    rust_files(&src().join("kv"), &mut files);
    for f in files {
        let c = code(&f);
        for bad in ["wgpu::", "crate::gpu", "crate::exec", "crate::model", "crate::ops"] {
            assert!(!c.contains(bad), "{} mentions {bad}", f.display());
        }
    }
}

/// (The hub room is the Hugging Face Hub's client: a leaf the binary and the server call to
/// download files, whose whole job is HTTP requests; it serves nothing.)
#[test]
fn nothing_below_the_server_knows_http() {
    for (room, files) in rooms() {
        if room == "server" || room == "bench" || room == "hub" {
            continue;
        }
        for f in files {
            let c = code(&f);
            for http in ["axum::", "hyper::", "hyper_util::", "tower_http::", "reqwest::"] {
                assert!(!c.contains(http), "{} uses {http}", f.display());
            }
        }
    }
}

/// The rule's own test: a file using a room above it is reported.
#[test]
fn a_use_of_a_room_above_is_found() {
    let u = used("use crate::engine::request::Request;\nlet x = crate::server::start;");
    assert_eq!(u, BTreeSet::from(["engine".to_string(), "server".to_string()]));
    assert!(level("model").unwrap() < level("engine").unwrap());
}

/// The identifiers that name a family: `Arch`'s variants (read from the table's file) and the
/// families' modules.
fn family_names() -> Vec<String> {
    let table = std::fs::read_to_string(src().join("model/families/mod.rs")).unwrap();
    let body = &table[table.find("pub enum Arch {").unwrap()..];
    let body = &body[..body.find('}').unwrap()];
    let mut names: Vec<String> = body
        .lines()
        .map(str::trim)
        .filter(|l| !l.starts_with("//") && l.ends_with(','))
        .map(|l| l.trim_end_matches(',').to_string())
        .collect();
    for e in std::fs::read_dir(src().join("model/families")).unwrap() {
        let stem = e.unwrap().path().file_stem().unwrap().to_string_lossy().to_string();
        if stem != "mod" {
            names.push(format!("families::{stem}"));
        }
    }
    names
}

/// `code` without the contents of its string literals (messages may name a model).
fn without_strings(code: &str) -> String {
    let (mut out, mut in_str, mut escaped) = (String::new(), false, false);
    for c in code.chars() {
        match (in_str, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (true, false, '"') => {
                in_str = false;
                out.push(c);
            }
            (true, false, _) => {}
            (false, _, '"') => {
                in_str = true;
                out.push(c);
            }
            _ => out.push(c),
        }
    }
    out
}

/// Whether `code` has `name` as a whole identifier (or path).
fn names(code: &str, name: &str) -> bool {
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    code.match_indices(name).any(|(i, _)| {
        let before = code[..i].chars().next_back().is_none_or(|c| !ident(c));
        let after = code[i + name.len()..].chars().next().is_none_or(|c| !ident(c));
        before && after
    })
}

#[test]
fn only_the_families_name_a_family() {
    let fams = family_names();
    assert!(fams.len() > 10 && fams.iter().any(|f| f == "Gemma4") && fams.iter().any(|f| f == "families::qwen35"));
    let mut files = Vec::new();
    rust_files(&src().join("model"), &mut files);
    let mut bad = Vec::new();
    for f in files {
        let rel = f.strip_prefix(src()).unwrap().to_string_lossy().to_string();
        if rel.starts_with("model/families/") {
            continue;
        }
        let code = without_strings(&code(&f));
        if code.contains("Arch::") {
            bad.push(format!("{rel}: matches on Arch"));
        }
        for n in fams.iter().filter(|n| names(&code, n)) {
            bad.push(format!("{rel}: names {n}"));
        }
    }
    assert!(bad.is_empty(), "outside model/families/, files name families:\n{}", bad.join("\n"));
}

#[test]
fn a_file_naming_a_family_is_found() {
    let fams = family_names();
    let hit = |code: &str| {
        let code = without_strings(code);
        fams.iter().any(|n| names(&code, n)) || code.contains("Arch::")
    };
    assert!(hit("let x = cfg.arch == Arch::Gemma4;"));
    assert!(hit("use super::families::gptoss::GPTOSS;"));
    assert!(hit("fn f(x: Qwen35) {}"));
    assert!(!hit("let parallel_moe = cfg.family().dense_beside_experts;"));
    assert!(!hit(r#"let gemma4_like = 1; bail!("no head (only Qwen3.5 has one) \"Gemma4\"");"#));
    assert!(hit(r#"let s = "a\"b"; let t = Gemma4;"#));
}

/// Every format's experts are read by one loader (model/blocks/experts.rs), driven by the
/// format's names: no other file reads expert tensors or builds a layer's experts, and a family
/// gives names, not a loader of its own.
#[test]
fn one_expert_loader() {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let mut bad = Vec::new();
    for f in files {
        let rel = f.strip_prefix(src()).unwrap().to_string_lossy().to_string();
        if rel == "model/blocks/experts.rs" {
            continue;
        }
        let code = without_strings(&code(&f));
        if code.contains(".experts(&") {
            bad.push(format!("{rel}: reads expert tensors"));
        }
        if code.contains("HostMoe {") && !code.contains("pub struct HostMoe {") {
            bad.push(format!("{rel}: builds a layer's experts"));
        }
        if names(&code, "ExpertLoader") || code.contains("fn load_experts") {
            bad.push(format!("{rel}: has an expert loader of its own"));
        }
    }
    assert!(bad.is_empty(), "experts read outside model/blocks/experts.rs:\n{}", bad.join("\n"));
}

/// The ops family a file of src/ops/ belongs to (its file or folder name), or None for the
/// files that compose the families or serve them all.
fn ops_family(rel: &str) -> Option<&str> {
    let name = rel.strip_prefix("ops/")?.split('/').next()?.trim_end_matches(".rs");
    let shared = ["mod", "kernels", "cost", "wgsl", "kv_cache", "tune", "binding_tests"];
    (!shared.contains(&name) && !name.starts_with("harness")).then_some(name)
}

/// The fields of the composed kernels a file reads through the recorder (`r.kernels.<field>`).
fn kernel_fields(code: &str) -> BTreeSet<String> {
    code.match_indices("r.kernels.")
        .map(|(i, m)| code[i + m.len()..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect())
        .collect()
}

#[test]
fn ops_families_own_their_kernels() {
    assert!(!src().join("ops/sources.rs").exists(), "ops/sources.rs is back");
    let mut files = Vec::new();
    rust_files(&src().join("ops"), &mut files);
    let mut bad = Vec::new();
    let mut families = BTreeSet::new();
    for f in files {
        let rel = f.strip_prefix(src()).unwrap().to_string_lossy().to_string();
        let code = without_strings(&code(&f));
        let Some(family) = ops_family(&rel) else { continue };
        families.insert(family.to_string());
        // A family builds its kernels and takes them in its constructors: it never names the
        // composition, and reads only its own part of it when recording.
        if names(&code, "Kernels") || code.contains("kernels::") {
            bad.push(format!("{rel}: names the composed Kernels"));
        }
        for field in kernel_fields(&code).into_iter().filter(|k| k != family) {
            bad.push(format!("{rel}: reads the {field} family's kernels"));
        }
    }
    // The composition of the families' op kinds is one line each in `op_kinds!`: outside it,
    // ops/mod.rs and ops/cost.rs name no family's op (no arm per kernel to add there).
    for rel in ["ops/mod.rs", "ops/cost.rs"] {
        let code = without_strings(&code(&src().join(rel)));
        let code = code.split("#[cfg(test)]").next().unwrap();
        let outside = match code.find("op_kinds! {") {
            Some(i) => format!("{}{}", &code[..i], &code[i + code[i..].find("\n}").unwrap()..]),
            None => code.to_string(),
        };
        for (i, m) in outside.match_indices("OpKind::") {
            let next: String =
                outside[i + m.len()..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            if !next.is_empty() {
                bad.push(format!("{rel}: names OpKind::{next}"));
            }
        }
    }
    assert!(bad.is_empty(), "ops families reaching into the composition:\n{}", bad.join("\n"));
    for fam in ["attention", "delta", "matmul", "moe", "norm", "ple", "rope", "sample"] {
        assert!(families.contains(fam), "no ops family {fam}");
    }
    // The kernels' sources are the ops families': under gpu/ only the weight formats' snippets
    // are read from shaders/.
    let mut gpu_files = Vec::new();
    rust_files(&src().join("gpu"), &mut gpu_files);
    for f in gpu_files.iter().filter(|f| !f.ends_with("wformat.rs")) {
        assert!(!code(f).contains("shaders/"), "{} reads a kernel's source", f.display());
    }
    // shaders/ is grouped by family: common.wgsl, then one folder per ops family (and wfmt/).
    let root = src().parent().unwrap().join("shaders");
    for e in std::fs::read_dir(&root).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        if p.is_dir() {
            assert!(families.contains(&name) || name == "wfmt", "shaders/{name}/ is no ops family's");
        } else {
            assert_eq!(name, "common.wgsl", "shaders/{name} belongs in a family's folder");
        }
    }
}

#[test]
fn an_ops_family_reading_another_is_found() {
    assert_eq!(ops_family("ops/matmul/gemm.rs"), Some("matmul"));
    assert_eq!(ops_family("ops/norm.rs"), Some("norm"));
    assert_eq!(ops_family("ops/kernels.rs"), None);
    assert_eq!(ops_family("ops/harness_moe.rs"), None);
    let fields = kernel_fields("out(r.folded(&r.kernels.norm.rmsnorm, b)); let p = &r.kernels.moe.formats[&f];");
    assert_eq!(fields, BTreeSet::from(["norm".to_string(), "moe".to_string()]));
    assert!(names("fn f(k: &Kernels) {}", "Kernels") && !names("fn f(k: &NormKernels) {}", "Kernels"));
}

/// Files of src/engine/ that may name `EngineCore`: the core (the loop, its results, the thread
/// that starts it), its trace tests and their scripted executor.
const ENGINE_CORE: [&str; 5] =
    ["engine/core.rs", "engine/output.rs", "engine/handle.rs", "engine/trace_tests.rs", "engine/scripted.rs"];

/// Whether `code` names the engine's core.
fn reaches_core(code: &str) -> bool {
    let code = without_strings(code);
    names(&code, "EngineCore") || code.contains("super::core")
}

#[test]
fn only_the_engine_core_names_the_core() {
    let mut files = Vec::new();
    rust_files(&src().join("engine"), &mut files);
    let mut bad = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(src()).unwrap().to_string_lossy().to_string();
        if !ENGINE_CORE.contains(&rel.as_str()) && reaches_core(&code(f)) {
            bad.push(rel);
        }
    }
    assert!(
        bad.is_empty(),
        "engine files reaching into the core (proposers and heads go through engine/propose.rs):\n{}",
        bad.join("\n")
    );
    // The proposers and heads are there to be checked.
    for f in ["engine/draft.rs", "engine/mtp.rs", "engine/embed.rs", "engine/speculate.rs", "engine/propose.rs"] {
        assert!(files.iter().any(|p| p.ends_with(f)), "{f} is gone: update ENGINE_CORE's test");
    }
    assert!(reaches_core("impl EngineCore {") && reaches_core("use super::core::Command;"));
    assert!(!reaches_core("let s = \"EngineCore\"; use super::propose::Proposer;"));
}
