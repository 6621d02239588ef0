//! The models a `serve --models-dir DIR` server can load: every GGUF file (the first part of a
//! split one; not vision projectors) and every Transformers directory (`config.json` beside
//! `*.safetensors`) under DIR, three levels deep at most, named by the file's stem or the
//! directory's name (models that would share a name get their paths under DIR; see `scan`);
//! also the Hub models pulled through Ollama's `/api/pull` while the server runs
//! (`hf.co/OWNER/REPO[:QUANT]`). DIR is read again when a request names a model it does not
//! know, so files copied there are served without a restart.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::SystemTime;

/// Most levels below DIR that are searched.
const MAX_DEPTH: usize = 3;
/// Most directory entries looked at in one scan (a huge tree is not walked for ever).
const MAX_ENTRIES: usize = 20_000;

/// One model the server can load.
#[derive(Debug)]
pub struct Entry {
    pub name: String,
    pub path: PathBuf,
    /// Bytes of its weights on disk (every part of a split GGUF; a directory's safetensors).
    pub size: u64,
    pub modified: SystemTime,
    /// Its parameter count (GGUF headers), read once when asked.
    pub parameters: OnceLock<Option<u64>>,
}

impl Entry {
    pub fn new(name: String, path: PathBuf) -> Entry {
        let (size, modified) = weight_bytes(&path);
        Entry { name, path, size, modified, parameters: OnceLock::new() }
    }

    /// Its parameter count (a GGUF file's header; None for a directory).
    pub fn parameter_count(&self) -> Option<u64> {
        let path = &self.path;
        *self.parameters.get_or_init(|| path.is_file().then(|| crate::server::ollama::info::parameter_count(path))?)
    }
}

/// `text` (an error) with `path` written as its file name alone: where a model lives on the
/// server is not the client's business.
pub fn hide_path(text: &str, path: &Path) -> String {
    text.replace(&path.display().to_string(), &file_name(path))
}

/// A path's last part (a model's file or folder name).
pub fn file_name(path: &Path) -> String {
    path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default()
}

/// A split GGUF's part as (index, count), from llama.cpp's `NAME-00001-of-00003.gguf` names.
fn part_of(p: &Path) -> Option<(u32, u32)> {
    crate::hub::select::split_part(p.file_name()?.to_str()?)
}

/// `NAME` of a split GGUF's `NAME-00001-of-00003` stem.
fn split_base(stem: &str) -> &str {
    stem.rsplit_once("-of-").and_then(|(head, _)| head.rsplit_once('-')).map_or(stem, |(base, _)| base)
}

fn is_gguf(p: &Path) -> bool {
    p.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// A model's file as it is now: its weights' bytes and newest modification time.
pub type FileFacts = (u64, SystemTime);

/// The facts of the model at `path` now.
pub fn facts(path: &Path) -> FileFacts {
    weight_bytes(path)
}

/// Bytes of a model's weights and their newest modification time.
fn weight_bytes(path: &Path) -> FileFacts {
    let facts = |p: &Path| std::fs::metadata(p).ok().map(|m| (m.len(), m.modified().unwrap_or(SystemTime::UNIX_EPOCH)));
    let mut files: Vec<PathBuf> = Vec::new();
    if path.is_dir() {
        if let Ok(rd) = std::fs::read_dir(path) {
            files.extend(rd.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|e| e == "safetensors")));
        }
    } else {
        files.push(path.to_path_buf());
        if let Some((1, n)) = part_of(path) {
            let part = |i: u32| crate::formats::gguf_split::part_path(path, i as u64, n as u64).ok();
            files.extend((1..n).filter_map(part));
        }
    }
    files.iter().filter_map(|p| facts(p)).fold((0, SystemTime::UNIX_EPOCH), |(s, t), (b, m)| (s + b, t.max(m)))
}

/// A model found by a scan, with the names it may take, shortest first.
struct Found {
    path: PathBuf,
    /// The file's stem, a split file's base, or the folder's name.
    short: String,
    /// Its path under DIR with that last part (no `.gguf`).
    long: String,
    /// Its path under DIR as it is (with `.gguf`).
    full: String,
}

/// What a scan of DIR found: (name, path), sorted by name. The naming rule: a model is named by
/// its file's stem (a split file's base name, a folder's name); models that would share a name
/// are named by their paths under DIR instead (without `.gguf`; so a top-level file keeps its
/// stem), and where even those are shared, with `.gguf`. Names are unique and do not depend on
/// the order files are found in. A file or folder whose name holds a comma or a control
/// character is not served (a warning says so, once).
pub fn scan(dir: &Path) -> Vec<(String, PathBuf)> {
    let mut found: Vec<(String, PathBuf)> = Vec::new();
    let mut budget = MAX_ENTRIES;
    walk(dir, dir, 0, &mut budget, &mut found);
    let mut models: Vec<Found> = Vec::new();
    for (short, path) in found {
        let rel = path.strip_prefix(dir).unwrap_or(&path).to_string_lossy().replace('\\', "/");
        if let Some(bad) = unservable(&rel) {
            warn_once(&path, &format!("is not served: its name holds {bad}"));
            continue;
        }
        let parent = rel.rsplit_once('/').map(|(p, _)| format!("{p}/")).unwrap_or_default();
        models.push(Found { long: format!("{parent}{short}"), full: rel, short, path });
    }
    let count = |names: &[String], n: &String| names.iter().filter(|m| *m == n).count();
    let mut names: Vec<String> = models.iter().map(|m| m.short.clone()).collect();
    let shorts = names.clone();
    for (i, m) in models.iter().enumerate() {
        if count(&shorts, &m.short) > 1 {
            names[i] = m.long.clone();
        }
    }
    let longs = names.clone();
    for (i, m) in models.iter().enumerate() {
        if count(&longs, &longs[i]) > 1 {
            names[i] = m.full.clone();
        }
    }
    let mut named: Vec<(String, PathBuf)> = Vec::new();
    for (name, m) in names.iter().zip(models) {
        if count(&names, name) > 1 {
            warn_once(&m.path, &format!("is not served: another model is also named {name:?}"));
        } else {
            named.push((name.clone(), m.path));
        }
    }
    named.sort_by(|a, b| a.0.cmp(&b.0));
    named
}

/// What in a model's path under DIR keeps it from being served: a comma (the models'
/// processes take comma-separated names) or a control character (names and paths are logged).
fn unservable(rel: &str) -> Option<&'static str> {
    if rel.chars().any(char::is_control) {
        Some("a control character")
    } else if rel.contains(',') {
        Some("a comma")
    } else {
        None
    }
}

/// `text` with its control characters escaped (`\n`, `\u{1b}`), for one line of the log.
pub fn printable(text: &str) -> String {
    text.chars().map(|c| if c.is_control() { c.escape_default().to_string() } else { c.to_string() }).collect()
}

/// Logs `what` about `path` the first time only (DIR is read again and again).
fn warn_once(path: &Path, what: &str) {
    static SEEN: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|e| e.into_inner());
    if seen.iter().any(|p| p == path) || seen.len() >= 1000 {
        return;
    }
    seen.push(path.to_path_buf());
    eprintln!("torus-wgpu serve: {:?} {what}", path.display().to_string());
}

/// Whether `path` looks like a model this server can load, read without loading it: a GGUF
/// file's header, metadata and tensor table (every part of a split one) with its architecture
/// named; a folder's config.json, a JSON object naming its architecture. A file that fails
/// this never makes room for itself.
pub fn check_loadable(path: &Path) -> Result<(), String> {
    let hidden = |e: anyhow::Error| hide_path(&format!("{e:#}"), path);
    if path.is_dir() {
        let config = path.join("config.json");
        let mut text = String::new();
        let read = std::fs::File::open(&config).and_then(|f| f.take(16 << 20).read_to_string(&mut text));
        read.map_err(|e| format!("config.json: {e}"))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| format!("config.json: {e}"))?;
        if !(v.get("architectures").is_some() || v.get("model_type").is_some()) {
            return Err("config.json names no architecture".into());
        }
        return Ok(());
    }
    let g = crate::formats::gguf::GgufFile::open(path).map_err(hidden)?;
    if g.get_str("general.architecture").is_none() {
        return Err(format!("{}: the GGUF file names no architecture", file_name(path)));
    }
    Ok(())
}

fn walk(root: &Path, dir: &Path, depth: usize, budget: &mut usize, out: &mut Vec<(String, PathBuf)>) {
    let Ok(rd) = std::fs::read_dir(dir) else { return };
    let mut entries: Vec<PathBuf> = Vec::new();
    for e in rd.flatten() {
        if *budget == 0 {
            return;
        }
        *budget -= 1;
        if !e.file_name().to_string_lossy().starts_with('.') {
            entries.push(e.path());
        }
    }
    entries.sort();
    for p in entries {
        let name = file_name(&p);
        if p.is_dir() {
            let hf = p.join("config.json").is_file()
                && std::fs::read_dir(&p)
                    .map(|rd| rd.flatten().any(|e| e.path().extension().is_some_and(|x| x == "safetensors")))
                    .unwrap_or(false);
            if hf {
                out.push((name, p));
            } else if depth < MAX_DEPTH && p != root {
                walk(root, &p, depth + 1, budget, out);
            }
        } else if is_gguf(&p) && p.is_file() {
            let stem = p.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
            if stem.to_ascii_lowercase().starts_with("mmproj") {
                continue;
            }
            match part_of(&p) {
                Some((1, _)) => out.push((split_base(&stem).to_string(), p)),
                Some(_) => {}
                None => out.push((stem, p)),
            }
        }
    }
}

/// A model name as a client may send it: Ollama's `:latest` tag is no tag.
pub fn plain_name(name: &str) -> &str {
    name.strip_suffix(":latest").unwrap_or(name)
}

/// `hf.co/OWNER/REPO[:QUANT]` (Ollama's spelling of a Hub model) as `OWNER/REPO[:QUANT]`.
pub fn hub_name(name: &str) -> Option<&str> {
    let rest = name.strip_prefix("hf.co/").or_else(|| name.strip_prefix("huggingface.co/"))?;
    Some(plain_name(rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_gguf_files_split_files_and_transformers_directories() {
        let d = std::env::temp_dir().join(format!("torus-catalog-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        for (p, body) in [
            ("a.gguf", "x"),
            ("mmproj-a.gguf", "x"),
            ("big-00001-of-00002.gguf", "xx"),
            ("big-00002-of-00002.gguf", "yyy"),
            ("notes.txt", "x"),
            ("org/a.gguf", "x"),
            ("org/deep/er/still/z.gguf", "x"),
            ("hf/config.json", "{}"),
            ("hf/model.safetensors", "12345"),
            ("hf/inner.gguf", "x"),
            ("empty/config.json", "{}"),
        ] {
            let p = d.join(p);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, body).unwrap();
        }
        let names: Vec<String> = scan(&d).into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["a", "big", "hf", "org/a"]);
        let big = scan(&d).into_iter().find(|(n, _)| n == "big").unwrap().1;
        assert_eq!(Entry::new("big".into(), big).size, 5, "both parts counted");
        assert_eq!(Entry::new("hf".into(), d.join("hf")).size, 5);
        assert_eq!(plain_name("a:latest"), "a");
        assert_eq!(part_of(Path::new("d/m-00002-of-00003.gguf")), Some((2, 3)));
        assert_eq!(split_base("m-00002-of-00003"), "m");
        assert_eq!(part_of(Path::new("m-2-of-3.gguf")), None);
        let _ = std::fs::remove_dir_all(&d);
    }

    /// Names are unique whatever the files: a shared stem makes each model its path under DIR
    /// (a top-level file keeps its stem), a folder and a file of one name keep `.gguf` apart;
    /// names with a comma or a control character are not served; names like flags are names.
    #[test]
    fn names_are_unique_and_follow_one_rule() {
        let d = std::env::temp_dir().join(format!("torus-catalog-names-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        for p in [
            "m.gguf",
            "a/m.gguf",
            "b/m.gguf",
            "q,x.gguf",
            "q_x.gguf",
            "-x.gguf",
            "--help.gguf",
            "bad\nname.gguf",
            "esc\u{1b}[2J.gguf",
            "n.gguf",
            "n/config.json",
            "n/model.safetensors",
        ] {
            let p = d.join(p);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, "x").unwrap();
        }
        let found = scan(&d);
        let names: Vec<&str> = found.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["--help", "-x", "a/m", "b/m", "m", "n", "n.gguf", "q_x"]);
        let path_of = |n: &str| found.iter().find(|(m, _)| m == n).unwrap().1.clone();
        assert_eq!(path_of("m"), d.join("m.gguf"));
        assert_eq!(path_of("n"), d.join("n"));
        assert_eq!(path_of("n.gguf"), d.join("n.gguf"));
        assert_eq!(printable("a\nb\u{1b}"), "a\\nb\\u{1b}");
        let _ = std::fs::remove_dir_all(&d);
    }
}
