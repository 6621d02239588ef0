//! One loaded model: a `torus-wgpu serve` process of its own on a loopback port, started by the
//! models server with the same engine settings, a random API key only the parent knows, and
//! its stdin a pipe from the parent (`--exit-with-stdin`: if the parent dies, it exits too).
//! Unloading a model ends its process, which gives its device memory back whole; one model
//! that fails or crashes never takes another down with it.

use super::keep_alive::KeepAlive;
use std::collections::VecDeque;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How a model's process is started: the program and the arguments every model gets.
#[derive(Clone, Debug)]
pub struct Spawn {
    pub exe: PathBuf,
    /// Before `serve` (none for this program; tests start a stand-in through `sh -c`).
    pub before: Vec<String>,
    /// After `serve`: the engine config file and the server flags passed on.
    pub args: Vec<String>,
}

/// Lines of a model's log kept for the error a failed load reports.
const TAIL: usize = 12;

/// A model's running process.
pub struct Child {
    /// Unique among this server's loads.
    pub id: u64,
    pub name: String,
    pub port: u16,
    pub key: String,
    /// Bytes it is counted as holding: its memory plan's total as its process reported it (the
    /// estimate, weights on disk + KV cache, where it did not).
    pub bytes: u64,
    pub loaded_at: std::time::SystemTime,
    /// Requests being proxied to it (a model with none is idle, and may be unloaded).
    pub in_flight: AtomicUsize,
    pub last_used: Mutex<Instant>,
    /// Unload once the requests in flight end (a client asked while it was busy).
    pub unload_when_idle: AtomicBool,
    /// How long it stays loaded once idle (the last request's `keep_alive`, or the server's).
    keep_alive: Mutex<KeepAlive>,
    alive: Arc<AtomicBool>,
    process: Arc<Mutex<std::process::Child>>,
    /// Held so the pipe stays open while the parent lives.
    _stdin: Option<std::process::ChildStdin>,
}

impl Child {
    pub fn alive(&self) -> bool {
        self.alive.load(SeqCst)
    }

    pub fn set_keep_alive(&self, k: KeepAlive) {
        *self.keep_alive.lock().unwrap_or_else(|e| e.into_inner()) = k;
    }

    /// When it will be unloaded if it stays idle (None: not by time).
    pub fn expires(&self) -> Option<Instant> {
        match *self.keep_alive.lock().unwrap_or_else(|e| e.into_inner()) {
            KeepAlive::Forever => None,
            KeepAlive::For(d) => Some(*self.last_used.lock().unwrap_or_else(|e| e.into_inner()) + d),
        }
    }

    /// Ends the process (an idle model's: nothing is lost).
    pub fn kill(&self) {
        if let Ok(mut p) = self.process.lock() {
            let _ = p.kill();
        }
    }
}

/// A fresh secret for a model's process.
fn new_key() -> String {
    let mut rng = crate::sampling::Rng::from_entropy();
    (0..4).map(|_| format!("{:016x}", rng.next_u64())).collect()
}

/// The bytes of the memory plans a ready line reports (`memory: weights ... = 257.7 MiB`, once
/// per pipeline stage), summed; None where it reports none.
fn planned_bytes(line: &str) -> Option<u64> {
    let mut total = None;
    for part in line.split("memory: ").skip(1) {
        let Some(mib) = part.split(" MiB)").next().and_then(|p| p.rsplit("= ").next()) else { continue };
        if let Ok(v) = mib.trim().parse::<f64>() {
            *total.get_or_insert(0) += (v * (1u64 << 20) as f64) as u64;
        }
    }
    total
}

/// The command line of model `name` at `path`.
fn command(spawn: &Spawn, name: &str, path: &std::path::Path) -> Command {
    let mut cmd = Command::new(&spawn.exe);
    cmd.args(&spawn.before)
        .arg("serve")
        .args(&spawn.args)
        // `--flag=VALUE`: a file named `-x.gguf` or `--help.gguf` is a value, never a flag.
        .arg(with_flag("--model=", path.as_os_str()))
        // Ollama's clients may add `:latest` on any route.
        .arg(format!("--served-model-name={name}"))
        .arg(format!("--served-model-name={name}:latest"))
        .args(["--host", "127.0.0.1", "--port", "0", "--exit-with-stdin"])
        .args(["--no-webui", "--no-pull"]);
    cmd
}

/// `FLAG=VALUE` as one argument (a path need not be UTF-8).
fn with_flag(flag: &str, value: &std::ffi::OsStr) -> std::ffi::OsString {
    let mut a = std::ffi::OsString::from(flag);
    a.push(value);
    a
}

/// The port of `torus-wgpu serve: listening on http://127.0.0.1:PORT (...`.
fn listening_port(line: &str) -> Option<u16> {
    let rest = line.split("listening on http://").nth(1)?;
    let addr = rest.split_whitespace().next()?;
    addr.rsplit_once(':')?.1.parse().ok()
}

/// Starts `path` as model `name` and waits (up to `limit`) until it serves; `on_exit` runs
/// once when the process ends, whenever that is. The error of a load that fails carries the
/// last lines the process printed.
pub async fn start(
    spawn: &Spawn,
    id: u64,
    name: &str,
    path: &std::path::Path,
    bytes: u64,
    limit: Duration,
    on_exit: impl FnOnce() + Send + 'static,
) -> Result<Child, String> {
    let key = new_key();
    let mut cmd = command(spawn, name, path);
    cmd.env("TORUS_API_KEY", &key)
        .env_remove("TORUS_MODELS_DIR")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut p = cmd.spawn().map_err(|e| format!("cannot start {}: {e}", spawn.exe.display()))?;
    let stdin = p.stdin.take();
    let stderr = p.stderr.take().ok_or("no stderr pipe")?;
    let (tx, rx) = tokio::sync::oneshot::channel::<Result<(u16, Option<u64>), String>>();
    let tag = name.to_string();
    std::thread::Builder::new()
        .name("torus-model-log".into())
        .spawn(move || {
            let mut tx = Some(tx);
            let mut port = None;
            let mut tail: VecDeque<String> = VecDeque::new();
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                // A model's own output, one line of the log each, control characters escaped.
                eprintln!("[{tag}] {}", super::catalog::printable(&line));
                if port.is_none() {
                    port = listening_port(&line);
                }
                if line.contains("torus-wgpu serve: ready on http://") {
                    if let (Some(tx), Some(p)) = (tx.take(), port) {
                        let _ = tx.send(Ok((p, planned_bytes(&line))));
                    }
                }
                if tx.is_some() {
                    if tail.len() == TAIL {
                        tail.pop_front();
                    }
                    tail.push_back(line);
                }
            }
            if let Some(tx) = tx {
                let last = tail.iter().rev().find(|l| l.to_ascii_lowercase().starts_with("error")).cloned();
                let _ = tx.send(Err(last.unwrap_or_else(|| Vec::from(tail).join("\n"))));
            }
        })
        .map_err(|e| e.to_string())?;
    let alive = Arc::new(AtomicBool::new(true));
    let process = Arc::new(Mutex::new(p));
    {
        let (alive, process) = (alive.clone(), process.clone());
        std::thread::Builder::new()
            .name("torus-model-wait".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(Duration::from_millis(100));
                    let done = process.lock().map(|mut p| !matches!(p.try_wait(), Ok(None))).unwrap_or(true);
                    if done {
                        break;
                    }
                }
                alive.store(false, SeqCst);
                on_exit();
            })
            .map_err(|e| e.to_string())?;
    }
    let child = Child {
        id,
        name: name.to_string(),
        port: 0,
        key,
        bytes,
        loaded_at: std::time::SystemTime::now(),
        in_flight: AtomicUsize::new(0),
        last_used: Mutex::new(Instant::now()),
        unload_when_idle: AtomicBool::new(false),
        keep_alive: Mutex::new(KeepAlive::Forever),
        alive,
        process,
        _stdin: stdin,
    };
    match tokio::time::timeout(limit, rx).await {
        // Counted from now on as its own memory plan says, where it says.
        Ok(Ok(Ok((port, plan)))) => Ok(Child { port, bytes: plan.unwrap_or(bytes), ..child }),
        Ok(Ok(Err(why))) => {
            child.kill();
            Err(super::catalog::hide_path(&why, path))
        }
        Ok(Err(_)) => {
            child.kill();
            Err("the model's process ended without a word".into())
        }
        Err(_) => {
            child.kill();
            Err(format!("the model did not load within {} s", limit.as_secs()))
        }
    }
}

#[cfg(test)]
mod tests {
    /// The program's own parser reads a model named like a flag as a value: the path and the
    /// names arrive whole.
    #[test]
    fn names_like_flags_stay_values() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(subcommand)]
            command: Cmd,
        }
        #[derive(clap::Subcommand)]
        enum Cmd {
            Serve(Box<crate::server::ServeArgs>),
        }
        let spawn = super::Spawn { exe: "torus-wgpu".into(), before: vec![], args: vec![] };
        let cmd = super::command(&spawn, "--help", std::path::Path::new("-x.gguf"));
        let args: Vec<String> = cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
        let cli = Cli::try_parse_from(std::iter::once("torus-wgpu".to_string()).chain(args))
            .unwrap_or_else(|e| panic!("{e}"));
        let Cmd::Serve(s) = cli.command;
        assert_eq!(s.served_model_name, ["--help", "--help:latest"]);
        assert_eq!(s.engine.model.as_deref(), Some("-x.gguf"));
    }

    #[test]
    fn reads_the_port() {
        let l = "torus-wgpu serve: listening on http://127.0.0.1:43211 (no API key); loading ...";
        assert_eq!(super::listening_port(l), Some(43211));
        assert_eq!(super::listening_port("torus-wgpu serve: ready"), None);
        let ready =
            "torus-wgpu serve: ready on http://127.0.0.1:1 | model \"m\" (x) | adapter llvmpipe (kernel profile cpu; \
                     memory: weights 0.5 MiB + KV cache 256.0 MiB + scratch 1.5 MiB = 258.0 MiB) | KV cache";
        assert_eq!(super::planned_bytes(ready), Some(258 << 20));
        let two = "a (memory: weights 1 MiB = 2.0 MiB), b (memory: weights 1 MiB = 3.0 MiB) |";
        assert_eq!(super::planned_bytes(two), Some(5 << 20));
        assert_eq!(super::planned_bytes("ready on http://x | adapter y"), None);
    }
}
