//! Serving metrics with vLLM's benchmark definitions, computed from per-request timelines.
//!
//! TTFT = first token arrival - send; E2E latency = last arrival - send;
//! TPOT = (E2E - TTFT) / (output_tokens - 1) per request with more than one output token;
//! ITL = every gap between consecutive streamed chunks after the first;
//! goodput = requests meeting every given SLO, per second of the run.
//! Percentiles interpolate linearly between closest ranks (numpy's default).

use serde::{Deserialize, Serialize};

/// One request's timeline, in seconds from the start of the run.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct RequestRecord {
    pub send: f64,
    /// Arrival of every chunk that carried output text, in order.
    pub chunks: Vec<f64>,
    pub end: f64,
    pub prompt_tokens: usize,
    pub output_tokens: usize,
    pub success: bool,
    pub error: Option<String>,
    /// Times the request was sent again on a fresh connection because an attempt failed
    /// before any response arrived (a pooled keep-alive connection the server had closed, a
    /// refused connection).
    #[serde(default)]
    pub retries: usize,
}

impl RequestRecord {
    pub fn ttft(&self) -> Option<f64> {
        self.chunks.first().map(|t| t - self.send)
    }
    pub fn e2el(&self) -> f64 {
        self.end - self.send
    }
    pub fn tpot(&self) -> Option<f64> {
        let ttft = self.ttft()?;
        (self.output_tokens > 1).then(|| (self.e2el() - ttft) / (self.output_tokens - 1) as f64)
    }
    pub fn itls(&self) -> impl Iterator<Item = f64> + '_ {
        self.chunks.windows(2).map(|w| w[1] - w[0])
    }
}

/// Service-level objectives for goodput, in milliseconds.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Slo {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2el_ms: Option<f64>,
}

impl Slo {
    /// Parses "ttft:MS tpot:MS e2el:MS" items (any subset).
    pub fn parse(items: &[String]) -> Result<Slo, String> {
        let mut s = Slo::default();
        for it in items.iter().flat_map(|i| i.split_whitespace()) {
            let (k, v) = it.split_once(':').ok_or_else(|| format!("goodput item '{it}' is not NAME:MS"))?;
            let ms: f64 = v.parse().map_err(|_| format!("goodput item '{it}': '{v}' is not a number of ms"))?;
            if ms.is_nan() || ms <= 0.0 {
                return Err(format!("goodput item '{it}': the limit must be positive"));
            }
            match k {
                "ttft" => s.ttft_ms = Some(ms),
                "tpot" => s.tpot_ms = Some(ms),
                "e2el" => s.e2el_ms = Some(ms),
                _ => return Err(format!("goodput item '{it}': unknown metric '{k}' (ttft, tpot, e2el)")),
            }
        }
        Ok(s)
    }

    pub fn is_set(&self) -> bool {
        self.ttft_ms.is_some() || self.tpot_ms.is_some() || self.e2el_ms.is_some()
    }

    /// Whether a successful request meets every set objective (a missing TPOT, for a
    /// one-token output, meets the TPOT objective).
    pub fn met_by(&self, r: &RequestRecord) -> bool {
        let ok = |limit: Option<f64>, v: Option<f64>| match (limit, v) {
            (Some(l), Some(v)) => v * 1000.0 <= l,
            (Some(_), None) => false,
            (None, _) => true,
        };
        r.success
            && ok(self.ttft_ms, r.ttft())
            && ok(self.tpot_ms, Some(r.tpot().unwrap_or(0.0)))
            && ok(self.e2el_ms, Some(r.e2el()))
    }
}

/// Mean, median and tail percentiles of one metric, in milliseconds.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Stats {
    pub mean: f64,
    pub median: f64,
    pub std: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
}

/// Percentile `q` (0..=100) of sorted values, linear interpolation between closest ranks.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let pos = q / 100.0 * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

impl Stats {
    /// From values in seconds; reported in milliseconds. Empty input gives zeros.
    pub fn of_seconds(values: impl IntoIterator<Item = f64>) -> Stats {
        let mut v: Vec<f64> = values.into_iter().map(|x| x * 1000.0).collect();
        if v.is_empty() {
            return Stats::default();
        }
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let std = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
        Stats {
            mean,
            median: percentile(&v, 50.0),
            std,
            p90: percentile(&v, 90.0),
            p95: percentile(&v, 95.0),
            p99: percentile(&v, 99.0),
        }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    pub completed: usize,
    pub failed: usize,
    /// Resends on a fresh connection, over all requests (see RequestRecord::retries).
    #[serde(default)]
    pub retries: usize,
    pub duration_s: f64,
    pub total_input_tokens: usize,
    pub total_output_tokens: usize,
    pub request_throughput: f64,
    pub output_throughput: f64,
    pub total_token_throughput: f64,
    /// Requests per second meeting every SLO (None when no SLO was given).
    pub goodput: Option<f64>,
    pub ttft_ms: Stats,
    pub tpot_ms: Stats,
    pub itl_ms: Stats,
    pub e2el_ms: Stats,
}

/// Aggregates a run's records; `duration` is the run's wall time in seconds.
pub fn summarize(records: &[RequestRecord], duration: f64, slo: &Slo) -> Summary {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.success).collect();
    let total_in: usize = ok.iter().map(|r| r.prompt_tokens).sum();
    let total_out: usize = ok.iter().map(|r| r.output_tokens).sum();
    let d = duration.max(1e-9);
    Summary {
        completed: ok.len(),
        failed: records.len() - ok.len(),
        retries: records.iter().map(|r| r.retries).sum(),
        duration_s: duration,
        total_input_tokens: total_in,
        total_output_tokens: total_out,
        request_throughput: ok.len() as f64 / d,
        output_throughput: total_out as f64 / d,
        total_token_throughput: (total_in + total_out) as f64 / d,
        goodput: slo.is_set().then(|| ok.iter().filter(|r| slo.met_by(r)).count() as f64 / d),
        ttft_ms: Stats::of_seconds(ok.iter().filter_map(|r| r.ttft())),
        tpot_ms: Stats::of_seconds(ok.iter().filter_map(|r| r.tpot())),
        itl_ms: Stats::of_seconds(ok.iter().flat_map(|r| r.itls())),
        e2el_ms: Stats::of_seconds(ok.iter().map(|r| r.e2el())),
    }
}
