//! llama-server's `timings` object (the prompt's and the generation's times, per token and per
//! second) and its `prompt_progress` chunks: on `/completion` always (timings) or when asked
//! (`return_progress`), on the OpenAI routes when asked (`timings_per_token`,
//! `return_progress`).

use crate::engine::Usage;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// One choice's clock: when its request came, its first token, the tokens so far, and the
/// prompt tokens it computed (those not found in the prefix cache, once known).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Clock {
    t0: Instant,
    first: Option<Instant>,
    predicted: usize,
    prompt_n: usize,
}

impl Clock {
    pub fn new(t0: Instant, prompt_tokens: usize) -> Clock {
        Clock { t0, first: None, predicted: 0, prompt_n: prompt_tokens }
    }

    /// A finished choice's clock: its first token's time and its usage.
    pub fn finished(t0: Instant, first: Option<Instant>, u: &Usage) -> Clock {
        let mut c = Clock::new(t0, u.prompt_tokens);
        c.first = first;
        c.done(u);
        c
    }

    /// A token came (the first one ends the prompt's time).
    pub fn token(&mut self) {
        self.first.get_or_insert_with(Instant::now);
        self.predicted += 1;
    }

    /// A prefill-progress event: the `prompt_progress` object llama-server sends (`processed`
    /// counts the cached tokens too, as there).
    pub fn progress(&mut self, processed: usize, cached: usize, total: usize) -> Value {
        self.prompt_n = total.saturating_sub(cached);
        let time_ms = ms(self.t0.elapsed());
        json!({"total": total, "cache": cached, "processed": processed, "time_ms": time_ms})
    }

    /// The choice ended with `u`: the exact counts.
    pub fn done(&mut self, u: &Usage) {
        self.prompt_n = u.prompt_tokens.saturating_sub(u.cached_tokens);
        self.predicted = u.completion_tokens;
    }

    /// The `timings` object now: the prompt's time runs to the first token (or to now, before
    /// it), the generation's from there.
    pub fn timings(&self) -> Value {
        let now = Instant::now();
        let first = self.first.unwrap_or(now);
        let (prompt_ms, predicted_ms) = (ms(first - self.t0), ms(now - first));
        let per = |n: usize, ms: f64| if n == 0 { (0.0, 0.0) } else { (ms / n as f64, n as f64 * 1e3 / ms.max(1e-9)) };
        let (ppt, pps) = per(self.prompt_n, prompt_ms);
        let (gpt, gps) = per(self.predicted, predicted_ms);
        json!({
            "prompt_n": self.prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": ppt,
            "prompt_per_second": pps,
            "predicted_n": self.predicted,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": gpt,
            "predicted_per_second": gps,
        })
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timings_add_up() {
        let t0 = Instant::now() - Duration::from_millis(100);
        let mut c = Clock::new(t0, 10);
        let before = c.timings();
        assert_eq!((before["prompt_n"].as_u64(), before["predicted_n"].as_u64()), (Some(10), Some(0)));
        assert_eq!(before["predicted_per_second"], 0.0);
        assert!(before["prompt_ms"].as_f64().unwrap() >= 100.0, "{before}");
        let p = c.progress(8, 6, 10);
        assert_eq!((p["total"].as_u64(), p["cache"].as_u64(), p["processed"].as_u64()), (Some(10), Some(6), Some(8)));
        c.token();
        c.token();
        let t = c.timings();
        assert_eq!((t["prompt_n"].as_u64(), t["predicted_n"].as_u64()), (Some(4), Some(2)));
        let (ms, per) = (t["prompt_ms"].as_f64().unwrap(), t["prompt_per_token_ms"].as_f64().unwrap());
        assert!((per * 4.0 - ms).abs() < 1e-6, "{t}");
        c.done(&Usage { prompt_tokens: 10, cached_tokens: 2, completion_tokens: 3, ..Default::default() });
        let t = c.timings();
        assert_eq!((t["prompt_n"].as_u64(), t["predicted_n"].as_u64()), (Some(8), Some(3)));
    }
}
