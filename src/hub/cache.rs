//! One repository's folder in the Hugging Face cache, laid out as `huggingface_hub` lays it out:
//! `models--ORG--NAME/` with `refs/main` (the text of a commit), `blobs/ETAG` (a file's bytes,
//! named by its sha256 or git blob id) and `snapshots/COMMIT/FILE`, a relative symlink to
//! `../../blobs/ETAG`. Blobs being downloaded are `blobs/ETAG.incomplete`, under the lock
//! `blobs/ETAG.lock` (the Python client's names, so either client resumes the other's download
//! and neither writes into one the other is writing).
//!
//! What the Hub says (a commit, an etag, a file name) is data, never a path until it is checked
//! against its format ([`is_commit`], [`etag`], [`file_name`]); what the cache holds is checked
//! when read (`refs/main` must name a commit; a snapshot's file must resolve to a regular file in
//! this repository's `blobs/` or in the snapshot itself; a snapshot is listed without following
//! symlinked folders, to a bounded depth and number of entries). Nothing outside
//! `models--ORG--NAME/` is created, followed, read or deleted.

use anyhow::{bail, Context, Result};
use std::io::Read;
use std::path::{Path, PathBuf};

/// Most entries looked at when a snapshot is listed.
const MAX_ENTRIES: usize = 10_000;
/// Most folder levels below a snapshot that are listed.
const MAX_DEPTH: usize = 8;
/// Longest file name (with its folders) taken from a listing.
const MAX_NAME_BYTES: usize = 512;

/// A git commit as the Hub names it: 40 hexadecimal digits.
pub fn is_commit(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A blob's name from an etag as the Hub sends it (`"…"`, `W/"…"`): a sha256 (64 hexadecimal
/// digits, for LFS files) or a git blob id (40); None for anything else.
pub fn etag(raw: &str) -> Option<String> {
    let t = raw.trim();
    let t = t.strip_prefix("W/").unwrap_or(t);
    let t = t.strip_prefix('"').and_then(|t| t.strip_suffix('"')).unwrap_or(t);
    ((t.len() == 64 || t.len() == 40) && t.bytes().all(|b| b.is_ascii_hexdigit())).then(|| t.to_ascii_lowercase())
}

/// Ok when `name` (a file of a repository, `/` between folders) is a relative path that stays
/// inside the snapshot: no empty, `.` or `..` part, no backslash, colon or control character.
pub fn file_name(name: &str) -> Result<(), String> {
    let bad_part = |p: &str| p.is_empty() || p == "." || p == "..";
    let bad_char = |c: char| c.is_control() || c == '\\' || c == ':';
    if name.len() > MAX_NAME_BYTES || name.split('/').any(bad_part) || name.chars().any(bad_char) {
        return Err(format!("the listing names an unsafe file {name:?}"));
    }
    Ok(())
}

/// `models--ORG--NAME/` under the hub cache.
pub struct RepoCache {
    root: PathBuf,
}

impl RepoCache {
    /// `repo` is `OWNER/REPO` as [`super::Spec`] checked it (letters, digits, `._-`).
    pub fn new(cache: &Path, repo: &str) -> RepoCache {
        RepoCache { root: cache.join(format!("models--{}", repo.replace('/', "--"))) }
    }

    #[cfg(test)]
    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn snapshot(&self, commit: &str) -> PathBuf {
        self.root.join("snapshots").join(commit)
    }

    /// The commit `refs/main` names (None: there is none); an error when it names no commit.
    pub fn main_ref(&self) -> Result<Option<String>, String> {
        let path = self.root.join("refs").join("main");
        match std::fs::symlink_metadata(&path) {
            Err(_) => return Ok(None),
            Ok(m) if !m.is_file() => return Err("the cache's refs/main is not a file".into()),
            Ok(_) => {}
        }
        let mut text = String::new();
        let read = std::fs::File::open(&path).and_then(|f| f.take(128).read_to_string(&mut text));
        if read.is_err() {
            return Err("the cache's refs/main cannot be read".into());
        }
        let commit = text.trim();
        if !is_commit(commit) {
            return Err(format!(
                "the cache's refs/main names no commit ({:?})",
                commit.chars().take(48).collect::<String>()
            ));
        }
        Ok(Some(commit.to_ascii_lowercase()))
    }

    /// Points `refs/main` at `commit` (written beside, then renamed over the old one).
    pub fn set_main_ref(&self, commit: &str) -> Result<()> {
        if !is_commit(commit) {
            bail!("{commit:?} is not a commit");
        }
        let refs = self.root.join("refs");
        std::fs::create_dir_all(&refs).with_context(|| format!("cannot create {}", refs.display()))?;
        let tmp = refs.join(".main.tmp");
        std::fs::write(&tmp, commit).with_context(|| format!("cannot write {}", tmp.display()))?;
        std::fs::rename(&tmp, refs.join("main")).with_context(|| format!("cannot write {}", refs.display()))
    }

    /// The files of snapshot `commit` (relative, `/` between folders), sorted: symlinked
    /// folders are not entered, at most [`MAX_DEPTH`] levels and [`MAX_ENTRIES`] entries.
    pub fn list(&self, commit: &str) -> Vec<String> {
        fn walk(dir: &Path, prefix: &str, depth: usize, budget: &mut usize, out: &mut Vec<String>) {
            let Ok(rd) = std::fs::read_dir(dir) else { return };
            for e in rd.flatten() {
                if *budget == 0 {
                    return;
                }
                *budget -= 1;
                let Ok(ty) = e.file_type() else { continue };
                let Some(name) = e.file_name().to_str().map(str::to_string) else { continue };
                let rel = if prefix.is_empty() { name } else { format!("{prefix}/{name}") };
                if ty.is_dir() {
                    if depth < MAX_DEPTH {
                        walk(&e.path(), &rel, depth + 1, budget, out);
                    }
                } else if ty.is_file() || ty.is_symlink() {
                    out.push(rel);
                }
            }
        }
        let snapshot = self.snapshot(commit);
        if !std::fs::symlink_metadata(&snapshot).is_ok_and(|m| m.is_dir()) {
            return Vec::new();
        }
        let (mut out, mut budget) = (Vec::new(), MAX_ENTRIES);
        walk(&snapshot, "", 0, &mut budget, &mut out);
        out.sort();
        out
    }

    /// `file` of snapshot `commit` when the cache holds it whole and it stays inside this
    /// repository: the link resolves to a regular file in `blobs/` (or is a regular file in
    /// the snapshot, as caches without symlinks keep them).
    pub fn resolve(&self, commit: &str, file: &str) -> Option<PathBuf> {
        if !is_commit(commit) || file_name(file).is_err() {
            return None;
        }
        let path = self.snapshot(commit).join(file);
        let real = std::fs::canonicalize(&path).ok()?;
        let root = std::fs::canonicalize(&self.root).ok()?;
        let inside = real.starts_with(root.join("blobs")) || real.starts_with(root.join("snapshots").join(commit));
        (inside && std::fs::metadata(&real).is_ok_and(|m| m.is_file())).then_some(path)
    }

    /// Whether every file directly in snapshot `commit` (a Transformers model's folder, which
    /// its loader reads as a whole) stays inside this repository.
    pub fn snapshot_contained(&self, commit: &str) -> bool {
        self.list(commit).iter().filter(|f| !f.contains('/')).all(|f| self.resolve(commit, f).is_some())
    }

    /// Where blob `etag` lives (a name [`etag`] returned).
    pub fn blob(&self, etag: &str) -> PathBuf {
        self.root.join("blobs").join(etag)
    }

    /// Where blob `etag` is downloaded to.
    pub fn partial(&self, etag: &str) -> PathBuf {
        self.root.join("blobs").join(format!("{etag}.incomplete"))
    }

    /// The lock a download of blob `etag` holds.
    pub fn lock(&self, etag: &str) -> PathBuf {
        self.root.join("blobs").join(format!("{etag}.lock"))
    }

    /// Creates `blobs/` (a folder of this repository's, not a link elsewhere).
    pub fn blobs_dir(&self) -> Result<PathBuf> {
        let dir = self.root.join("blobs");
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        if !std::fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) {
            bail!("{} is not a folder", dir.display());
        }
        Ok(dir)
    }

    /// Links `snapshots/COMMIT/FILE` to blob `etag`, replacing a link or file there.
    pub fn link(&self, commit: &str, file: &str, etag: &str) -> Result<PathBuf> {
        if !is_commit(commit) {
            bail!("{commit:?} is not a commit");
        }
        file_name(file).map_err(anyhow::Error::msg)?;
        let snapshot = self.snapshot(commit);
        let path = snapshot.join(file);
        let parent = path.parent().unwrap_or(&snapshot);
        std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
        let inside = std::fs::canonicalize(parent)
            .ok()
            .zip(std::fs::canonicalize(&self.root).ok())
            .is_some_and(|(p, root)| p.starts_with(root.join("snapshots").join(commit)));
        if !inside {
            bail!("{} leaves the snapshot", parent.display());
        }
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.is_dir() => bail!("{} is a folder", path.display()),
            Ok(_) => std::fs::remove_file(&path).with_context(|| format!("cannot replace {}", path.display()))?,
            Err(_) => {}
        }
        let up = "../".repeat(file.matches('/').count() + 2);
        let target = PathBuf::from(format!("{up}blobs/{etag}"));
        symlink(&target, &path).with_context(|| format!("cannot link {}", path.display()))?;
        Ok(path)
    }
}

#[cfg(unix)]
fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    std::os::unix::fs::symlink(target, link)
}

#[cfg(windows)]
fn symlink(target: &Path, link: &Path) -> std::io::Result<()> {
    std::os::windows::fs::symlink_file(target, link)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_values_are_checked_before_they_name_anything() {
        let sha = "a".repeat(64);
        assert_eq!(etag(&format!("\"{sha}\"")).as_deref(), Some(sha.as_str()));
        assert_eq!(etag(&format!("W/\"{}\"", "B".repeat(40))), Some("b".repeat(40)));
        for bad in
            ["\"/etc/passwd\"", "\"../../../../x\"", "", "\"\"", &"a".repeat(63), &format!("{}/x", "a".repeat(40))]
        {
            assert_eq!(etag(bad), None, "{bad}");
        }
        assert!(is_commit("0123456789abcdef0123456789abcdef01234567"));
        for bad in
            ["../../x", "main", "0123456789abcdef0123456789abcdef0123456", "0123456789abcdef0123456789abcdef0123456z"]
        {
            assert!(!is_commit(bad), "{bad}");
        }
        for ok in ["m.gguf", "sub/m-Q4_K_M.gguf", "a b.json"] {
            assert!(file_name(ok).is_ok(), "{ok}");
        }
        for bad in ["../x", "/abs", "a//b", "a/./b", "a\\..\\b", "C:x", "a\nb", "", "x/"] {
            assert!(file_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_cache_is_checked_when_read() {
        let d = std::env::temp_dir().join(format!("torus-hubcache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let repo = RepoCache::new(&d, "o/r");
        let commit = "0123456789abcdef0123456789abcdef01234567";
        assert_eq!(repo.main_ref(), Ok(None));
        repo.set_main_ref(commit).unwrap();
        assert_eq!(repo.main_ref(), Ok(Some(commit.to_string())));
        std::fs::write(repo.root().join("refs/main"), "../../../outside").unwrap();
        assert!(repo.main_ref().unwrap_err().contains("no commit"));
        // A link to a blob resolves; links out of the repository, and loops, do not.
        let sha = "c".repeat(64);
        std::fs::create_dir_all(repo.blobs_dir().unwrap()).unwrap();
        std::fs::write(repo.blob(&sha), b"x").unwrap();
        repo.link(commit, "sub/m.gguf", &sha).unwrap();
        assert_eq!(std::fs::read(repo.snapshot(commit).join("sub/m.gguf")).unwrap(), b"x");
        assert!(repo.resolve(commit, "sub/m.gguf").is_some());
        let outside = d.join("secret");
        std::fs::write(&outside, b"s").unwrap();
        symlink(&outside, &repo.snapshot(commit).join("out.gguf")).unwrap();
        assert!(repo.resolve(commit, "out.gguf").is_none());
        std::fs::create_dir_all(repo.snapshot(commit).join("loop")).unwrap();
        std::os::unix::fs::symlink("..", repo.snapshot(commit).join("loop/up")).unwrap();
        symlink(Path::new("x1"), &repo.snapshot(commit).join("x2")).unwrap();
        symlink(Path::new("x2"), &repo.snapshot(commit).join("x1")).unwrap();
        assert!(repo.resolve(commit, "x1").is_none());
        let names = repo.list(commit);
        assert_eq!(names, ["loop/up", "out.gguf", "sub/m.gguf", "x1", "x2"], "symlinked folders are not entered");
        assert!(!repo.snapshot_contained(commit));
        assert!(repo.resolve(commit, "../../../secret").is_none());
        let _ = std::fs::remove_dir_all(&d);
    }
}
