//! DNS rebinding: which `Host` headers the server answers. A web page can point a name it
//! controls at 127.0.0.1 and then call a server on localhost as its own origin (no CORS check
//! applies); only the `Host` header still shows the page's name. So a server bound to a loopback
//! address answers only `localhost`, `127.0.0.1` and `[::1]` (any port) unless
//! `--allowed-hosts` names more (`*`: any); elsewhere only the names `--allowed-hosts` gives, if
//! it gives any. Other hosts get 403 in the route's error shape (Ollama checks the same).

use super::error::{ApiError, Dialect};
use super::AppState;
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;
use std::sync::Arc;

/// The names loopback servers answer to.
const LOOPBACK_NAMES: [&str; 3] = ["localhost", "127.0.0.1", "[::1]"];

/// Which hosts a server answers.
#[derive(Clone, Debug, PartialEq)]
pub enum HostCheck {
    Any,
    /// Lowercase names without ports.
    Only(Vec<String>),
}

impl HostCheck {
    /// For a server bound to a loopback address or not, with `--allowed-hosts` `allowed`.
    pub fn new(loopback: bool, allowed: &[String]) -> Result<HostCheck, String> {
        let mut names = Vec::new();
        for a in allowed.iter().map(|a| a.trim()).filter(|a| !a.is_empty()) {
            if a == "*" {
                return Ok(HostCheck::Any);
            }
            let n = host_name(a).ok_or_else(|| format!("--allowed-hosts: {a:?} is not a host name"))?;
            names.push(n);
        }
        if names.is_empty() && !loopback {
            return Ok(HostCheck::Any);
        }
        if loopback {
            names.extend(LOOPBACK_NAMES.map(String::from));
        }
        Ok(HostCheck::Only(names))
    }

    /// Whether a request whose `Host` header is `host` (None: it sent none, as HTTP/1.0
    /// clients may; browsers always send one) is answered.
    pub fn allows(&self, host: Option<&str>) -> bool {
        match (self, host) {
            (HostCheck::Any, _) | (_, None) => true,
            (HostCheck::Only(names), Some(h)) => host_name(h).is_some_and(|n| names.contains(&n)),
        }
    }
}

/// The host part of a `Host` header or an `--allowed-hosts` entry, lowercase, without its port
/// or a final dot; None if it is not one (empty, spaces, a path, user info).
fn host_name(h: &str) -> Option<String> {
    let h = h.trim();
    if h.is_empty() || !h.bytes().all(|b| b.is_ascii_graphic()) || h.contains(['/', '@', '?', '#', '\\']) {
        return None;
    }
    let name = if h.starts_with('[') {
        // [v6] or [v6]:port
        let end = h.find(']')?;
        let rest = &h[end + 1..];
        if !(rest.is_empty() || rest.strip_prefix(':').is_some_and(|p| p.bytes().all(|b| b.is_ascii_digit()))) {
            return None;
        }
        &h[..=end]
    } else {
        match h.rsplit_once(':') {
            Some((n, p)) if p.bytes().all(|b| b.is_ascii_digit()) && !n.contains(':') => n,
            Some(_) => return None,
            None => h,
        }
    };
    let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    (!name.is_empty()).then_some(name)
}

/// The middleware: 403 for a request to a host the server does not answer.
pub(crate) async fn check_host(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let host = req.headers().get(header::HOST).map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    // HTTP/2 carries the host as the URI's authority.
    let host = host.or_else(|| req.uri().authority().map(|a| a.to_string()));
    if st.host_check.allows(host.as_deref()) {
        return next.run(req).await;
    }
    let shown: String = host.unwrap_or_default().chars().take(100).collect();
    ApiError::forbidden(format!(
        "host {shown:?} is not served here (DNS rebinding protection); start the server with \
             --allowed-hosts NAME (or `*`) to accept it"
    ))
    .code("host_not_allowed")
    .response_in(Dialect::of_path(req.uri().path()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_servers_answer_only_loopback_names() {
        let c = HostCheck::new(true, &[]).unwrap();
        for ok in ["localhost", "localhost:8000", "LOCALHOST.:1", "127.0.0.1:8000", "[::1]:8000", "[::1]"] {
            assert!(c.allows(Some(ok)), "{ok}");
        }
        for bad in [
            "evil.example",
            "evil.example:8000",
            "127.0.0.1.nip.io",
            "localhost.evil.example",
            "",
            "a b",
            "[::1]x",
            "x:y:z",
            "127.0.0.2",
        ] {
            assert!(!c.allows(Some(bad)), "{bad}");
        }
        assert!(c.allows(None));
    }

    #[test]
    fn allowed_hosts_add_names_or_turn_the_check_off() {
        let c = HostCheck::new(true, &["My-Box.lan:8000".into(), " ".into()]).unwrap();
        assert!(c.allows(Some("my-box.lan")) && c.allows(Some("localhost:1")) && !c.allows(Some("other.lan")));
        assert_eq!(HostCheck::new(true, &["*".into()]).unwrap(), HostCheck::Any);
        // Not on loopback: any host, unless names are given.
        assert_eq!(HostCheck::new(false, &[]).unwrap(), HostCheck::Any);
        let c = HostCheck::new(false, &["api.example".into()]).unwrap();
        assert!(c.allows(Some("api.example:443")) && !c.allows(Some("localhost")));
        for bad in ["http://x", "a/b", "user@host"] {
            assert!(HostCheck::new(true, &[bad.into()]).is_err(), "{bad}");
        }
    }
}
