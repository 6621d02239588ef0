//! How long an idle model stays loaded, as Ollama's `keep_alive` says it: a number of seconds or
//! a duration (`"5m"`, `"1h30m"`, `"90s"`, `"500ms"`); negative: until it is unloaded to make
//! room; 0: unloaded as soon as it is idle. Each request's value (or the server's
//! `--keep-alive`) applies from the end of that request on, as in Ollama.

use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeepAlive {
    /// Until unloaded to make room (or asked to).
    Forever,
    /// Unloaded once idle this long.
    For(Duration),
}

/// Longest keep-alive taken literally (longer: forever).
const MAX_SECS: f64 = 100.0 * 365.0 * 86_400.0;

impl KeepAlive {
    /// A JSON `keep_alive`: a number of seconds or a duration string.
    pub fn from_json(v: &serde_json::Value) -> Result<KeepAlive, String> {
        match v {
            serde_json::Value::Number(n) => Ok(secs(n.as_f64().unwrap_or(-1.0))),
            serde_json::Value::String(s) => KeepAlive::parse(s),
            _ => Err("`keep_alive` must be a number of seconds or a duration such as \"5m\"".into()),
        }
    }

    /// `"5m"`, `"1h30m"`, `"90s"`, `"500ms"`, `"-1"`, `"300"` (seconds).
    pub fn parse(s: &str) -> Result<KeepAlive, String> {
        let bad = || {
            format!(
                "keep_alive {s:?}: expected seconds or a duration such as 5m, 1h30m, 90s, 500ms (negative: forever)"
            )
        };
        let t = s.trim();
        if let Ok(n) = t.parse::<f64>() {
            return Ok(secs(n));
        }
        let (neg, mut rest) = match t.strip_prefix('-') {
            Some(r) => (true, r),
            None => (false, t),
        };
        if rest.is_empty() {
            return Err(bad());
        }
        let mut total = 0.0f64;
        while !rest.is_empty() {
            let digits = rest.find(|c: char| !(c.is_ascii_digit() || c == '.')).ok_or_else(bad)?;
            let n: f64 = rest[..digits].parse().map_err(|_| bad())?;
            rest = &rest[digits..];
            let (unit, len) = if rest.starts_with("ms") {
                (0.001, 2)
            } else {
                match rest.chars().next() {
                    Some('h') => (3600.0, 1),
                    Some('m') => (60.0, 1),
                    Some('s') => (1.0, 1),
                    _ => return Err(bad()),
                }
            };
            total += n * unit;
            rest = &rest[len..];
        }
        Ok(secs(if neg { -total } else { total }))
    }
}

fn secs(n: f64) -> KeepAlive {
    if !n.is_finite() || !(0.0..=MAX_SECS).contains(&n) {
        KeepAlive::Forever
    } else {
        KeepAlive::For(Duration::from_secs_f64(n))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_as_ollama_reads_them() {
        let f = |s: u64| KeepAlive::For(Duration::from_secs(s));
        assert_eq!(KeepAlive::parse("5m").unwrap(), f(300));
        assert_eq!(KeepAlive::parse("1h30m").unwrap(), f(5400));
        assert_eq!(KeepAlive::parse("90s").unwrap(), f(90));
        assert_eq!(KeepAlive::parse("300").unwrap(), f(300));
        assert_eq!(KeepAlive::parse("0").unwrap(), f(0));
        assert_eq!(KeepAlive::parse("500ms").unwrap(), KeepAlive::For(Duration::from_millis(500)));
        assert_eq!(KeepAlive::parse("-1").unwrap(), KeepAlive::Forever);
        assert_eq!(KeepAlive::parse("-5m").unwrap(), KeepAlive::Forever);
        assert_eq!(KeepAlive::from_json(&serde_json::json!(0)).unwrap(), f(0));
        assert_eq!(KeepAlive::from_json(&serde_json::json!(-1)).unwrap(), KeepAlive::Forever);
        for bad in ["", "5x", "m", "--1", "5 m", "1.2.3s"] {
            assert!(KeepAlive::parse(bad).is_err(), "{bad}");
        }
        assert!(KeepAlive::from_json(&serde_json::json!(true)).is_err());
    }
}
