//! What the server measures itself (responses by status, time to first token, inter-token
//! latency, token counts) and the Prometheus text for `GET /metrics`, which adds the engine's
//! gauges and counters.
//!
//! Besides the `torus_*` families, the same quantities are exported under vLLM's names (with
//! its `model_name` and `engine` labels), where the meaning and unit are the same: the
//! model-server contract that routers and autoscalers read (the Gateway API Inference
//! Extension's endpoint picker, vLLM's production-stack router, llm-d, KEDA/HPA rules) and the
//! families vLLM's Grafana dashboards chart. See [`ServerMetrics::render`].

use crate::engine::metrics::MetricsSnapshot;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

/// Bucket upper bounds in seconds (Prometheus `le`), plus the implicit +Inf.
const TTFT_BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5,
];
const E2E_BUCKETS: &[f64] = &[0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0, 600.0];
/// Token counts per request (vLLM's 1-2-5 series).
const TOKEN_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0, 10000.0, 20000.0, 50000.0, 100000.0,
];

#[derive(Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Per bucket (not cumulative); the last one is +Inf.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram { bounds, counts: vec![0; bounds.len() + 1], sum: 0.0, count: 0 }
    }

    pub fn observe(&mut self, seconds: f64) {
        let i = self.bounds.iter().position(|&b| seconds <= b).unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += seconds;
        self.count += 1;
    }

    /// `labels`: extra labels for every sample (`a="x",b="y"`), or empty.
    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let sep = if labels.is_empty() { String::new() } else { format!(",{labels}") };
        let braced = braced(labels);
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"{sep}}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"{sep}}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{braced} {}", self.sum);
        let _ = writeln!(out, "{name}_count{braced} {}", self.count);
    }
}

#[derive(Debug)]
pub struct ServerMetrics {
    statuses: Mutex<BTreeMap<u16, u64>>,
    pub ttft: Mutex<Histogram>,
    pub itl: Mutex<Histogram>,
    pub e2e: Mutex<Histogram>,
    /// Per finished sequence: its prompt and generated token counts.
    pub request_prompt_tokens: Mutex<Histogram>,
    pub request_generation_tokens: Mutex<Histogram>,
    /// Finished sequences by OpenAI finish reason (`stop`, `length`, `abort`, `error`).
    finished: Mutex<BTreeMap<&'static str, u64>>,
    /// Prompt tokens of the sequences the server finished (each choice counts its prompt).
    pub prompt_tokens: AtomicU64,
    /// Generated tokens of the sequences the server finished.
    pub generation_tokens: AtomicU64,
    /// Sequences submitted that have not produced their first token yet (the admission queue).
    pub queued: AtomicU64,
    /// Requests turned away because the queue was full.
    pub rejected_overloaded: AtomicU64,
    /// Requests cut off at their time limit (`request_timeout_s`).
    pub timed_out: AtomicU64,
    /// Open HTTP connections (both lanes; see `conn`).
    pub connections: AtomicU64,
    /// Connections closed at once: over the per-peer cap, or with every place taken.
    pub connections_refused: AtomicU64,
}

impl Default for ServerMetrics {
    fn default() -> Self {
        ServerMetrics {
            statuses: Mutex::new(BTreeMap::new()),
            ttft: Mutex::new(Histogram::new(TTFT_BUCKETS)),
            itl: Mutex::new(Histogram::new(ITL_BUCKETS)),
            e2e: Mutex::new(Histogram::new(E2E_BUCKETS)),
            request_prompt_tokens: Mutex::new(Histogram::new(TOKEN_BUCKETS)),
            request_generation_tokens: Mutex::new(Histogram::new(TOKEN_BUCKETS)),
            finished: Mutex::new(BTreeMap::new()),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            queued: AtomicU64::new(0),
            rejected_overloaded: AtomicU64::new(0),
            timed_out: AtomicU64::new(0),
            connections: AtomicU64::new(0),
            connections_refused: AtomicU64::new(0),
        }
    }
}

fn observe(h: &Mutex<Histogram>, d: Duration) {
    if let Ok(mut h) = h.lock() {
        h.observe(d.as_secs_f64());
    }
}

impl ServerMetrics {
    pub fn count_status(&self, status: u16) {
        if let Ok(mut m) = self.statuses.lock() {
            *m.entry(status).or_insert(0) += 1;
        }
    }

    /// Responses sent with this status so far.
    pub fn status_count(&self, status: u16) -> u64 {
        self.statuses.lock().map(|m| m.get(&status).copied().unwrap_or(0)).unwrap_or(0)
    }

    pub fn observe_ttft(&self, d: Duration) {
        observe(&self.ttft, d);
    }

    pub fn observe_itl(&self, d: Duration) {
        observe(&self.itl, d);
    }

    pub fn observe_e2e(&self, d: Duration) {
        observe(&self.e2e, d);
    }

    /// A sequence ended: its token counts and finish reason (OpenAI's string).
    pub fn observe_finished(&self, prompt_tokens: usize, generation_tokens: usize, reason: &'static str) {
        for (h, n) in
            [(&self.request_prompt_tokens, prompt_tokens), (&self.request_generation_tokens, generation_tokens)]
        {
            if let Ok(mut h) = h.lock() {
                h.observe(n as f64);
            }
        }
        if let Ok(mut m) = self.finished.lock() {
            *m.entry(reason).or_insert(0) += 1;
        }
    }

    /// A sequence given up before it finished (its client went away, or its time limit came):
    /// vLLM's `abort` finish reason.
    pub fn observe_aborted(&self) {
        if let Ok(mut m) = self.finished.lock() {
            *m.entry("abort").or_insert(0) += 1;
        }
    }

    /// The Prometheus text exposition; `engine` is None while the model is loading. `vllm`: the
    /// served model name and the engine's KV-cache geometry for the vLLM-named families.
    pub fn render(&self, engine: Option<&MetricsSnapshot>, vllm: &VllmLabels) -> String {
        let mut out = String::new();
        let mut metric =
            |name: &str, kind: &str, help: &str, value: String| sample(&mut out, name, kind, help, "", value);
        metric(
            "torus_model_loaded",
            "gauge",
            "1 once the model is loaded and requests are served.",
            u8::from(engine.is_some()).to_string(),
        );
        metric(
            "torus_engine_healthy",
            "gauge",
            "1 while the engine serves; 0 while the model loads and once its thread or device is gone.",
            u8::from(engine.is_some_and(|m| m.healthy)).to_string(),
        );
        metric(
            "torus_queued_requests",
            "gauge",
            "Sequences accepted by the server that have not produced their first token yet.",
            self.queued.load(Relaxed).to_string(),
        );
        metric(
            "torus_requests_rejected_overloaded_total",
            "counter",
            "Requests answered 503 because the queue was full.",
            self.rejected_overloaded.load(Relaxed).to_string(),
        );
        metric(
            "torus_requests_timed_out_total",
            "counter",
            "Requests aborted at their time limit (request_timeout_s).",
            self.timed_out.load(Relaxed).to_string(),
        );
        metric(
            "torus_http_connections",
            "gauge",
            "Open HTTP connections (at most max_connections, plus the probe lane's).",
            self.connections.load(Relaxed).to_string(),
        );
        metric(
            "torus_http_connections_refused_total",
            "counter",
            "Connections closed on arrival: over max_connections_per_peer, or every place taken.",
            self.connections_refused.load(Relaxed).to_string(),
        );
        metric(
            "torus_prompt_tokens_total",
            "counter",
            "Prompt tokens of finished sequences (each choice counts its prompt).",
            self.prompt_tokens.load(Relaxed).to_string(),
        );
        metric(
            "torus_generation_tokens_total",
            "counter",
            "Generated tokens of finished sequences.",
            self.generation_tokens.load(Relaxed).to_string(),
        );
        if let Some(m) = engine {
            let ratio = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
            metric(
                "torus_num_requests_waiting",
                "gauge",
                "Sequences in the engine's waiting queue.",
                m.waiting.to_string(),
            );
            metric("torus_num_requests_running", "gauge", "Sequences the engine is running.", m.running.to_string());
            metric("torus_kv_cache_blocks_total", "gauge", "KV-cache blocks.", m.kv_blocks_total.to_string());
            if m.state_slots_total > 0 {
                let help = "Recurrent-state slots held by running sequences (hybrid models).";
                metric("torus_state_slots_used", "gauge", help, m.state_slots_used.to_string());
            }
            metric(
                "torus_kv_cache_blocks_used",
                "gauge",
                "KV-cache blocks held by running sequences.",
                m.kv_blocks_used.to_string(),
            );
            metric(
                "torus_kv_cache_usage_ratio",
                "gauge",
                "Used over total KV-cache blocks (0..1).",
                ratio(m.kv_blocks_used, m.kv_blocks_total).to_string(),
            );
            metric(
                "torus_prefix_cache_queries_total",
                "counter",
                "Blocks looked up in the prefix cache.",
                m.prefix_queries.to_string(),
            );
            metric(
                "torus_prefix_cache_hits_total",
                "counter",
                "Blocks found in the prefix cache.",
                m.prefix_hits.to_string(),
            );
            metric(
                "torus_prefix_cache_hit_rate",
                "gauge",
                "Prefix-cache hits over queries since start (0..1).",
                ratio(m.prefix_hits, m.prefix_queries).to_string(),
            );
            metric(
                "torus_preemptions_total",
                "counter",
                "Sequences preempted for lack of KV blocks.",
                m.preemptions.to_string(),
            );
            metric(
                "torus_prefill_tokens_computed_total",
                "counter",
                "Prompt tokens the engine computed (prefix-cache hits excluded).",
                m.prefill_tokens.to_string(),
            );
            metric("torus_sampled_tokens_total", "counter", "Tokens the engine sampled.", m.decode_tokens.to_string());
            metric("torus_engine_steps_total", "counter", "Engine steps (GPU submissions).", m.steps.to_string());
            metric(
                "torus_kv_events_published_total",
                "counter",
                "KV-cache events published (--kv-events-endpoint).",
                m.kv_events_published.to_string(),
            );
            metric(
                "torus_kv_event_batches_published_total",
                "counter",
                "KV-cache event batches (ZeroMQ messages) published.",
                m.kv_event_batches_published.to_string(),
            );
            metric(
                "torus_kv_events_subscribers",
                "gauge",
                "Subscribers to the KV-cache events.",
                m.kv_events_subscribers.to_string(),
            );
            metric(
                "torus_kv_events_dropped_total",
                "counter",
                "KV-cache event messages dropped for subscribers too far behind.",
                m.kv_events_dropped.to_string(),
            );
            metric(
                "torus_engine_step_failures_total",
                "counter",
                "Steps that failed (panic, GPU error, mismatched result); their requests got an error.",
                m.step_failures.to_string(),
            );
            metric(
                "torus_pipeline_stage_failures_total",
                "counter",
                "Pipeline stage failures (a worker down or restarted).",
                m.stage_failures.to_string(),
            );
            metric(
                "torus_pipeline_overlapped_steps_total",
                "counter",
                "Steps submitted while another step was still in the pipeline.",
                m.steps_overlapped.to_string(),
            );
            let _ = writeln!(
                out,
                "# HELP torus_engine_requests_total Sequences the engine ended, by outcome.\n\
                 # TYPE torus_engine_requests_total counter\n\
                 torus_engine_requests_total{{outcome=\"finished\"}} {}\n\
                 torus_engine_requests_total{{outcome=\"aborted\"}} {}\n\
                 torus_engine_requests_total{{outcome=\"failed\"}} {}",
                m.requests_finished, m.requests_aborted, m.requests_failed
            );
        }
        self.render_statuses(&mut out, "torus_requests_total", "HTTP responses by status code.");
        let hist = |out: &mut String, h: &Mutex<Histogram>, name: &str, help: &str| {
            if let Ok(h) = h.lock() {
                h.render(out, name, help, "");
            }
        };
        hist(
            &mut out,
            &self.ttft,
            "torus_time_to_first_token_seconds",
            "From request arrival to a sequence's first token, measured in the server.",
        );
        hist(
            &mut out,
            &self.itl,
            "torus_inter_token_latency_seconds",
            "Gaps between consecutive tokens of a sequence, measured in the server.",
        );
        hist(
            &mut out,
            &self.e2e,
            "torus_e2e_request_latency_seconds",
            "From request arrival to a sequence's end, measured in the server.",
        );
        self.render_vllm(&mut out, engine, vllm);
        out
    }

    /// The responses by status code as counter `name`.
    fn render_statuses(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
        if let Ok(m) = self.statuses.lock() {
            for (status, n) in m.iter() {
                let _ = writeln!(out, "{name}{{status=\"{status}\"}} {n}");
            }
        }
    }

    /// A models server's own HTTP counters (`serve --models-dir`), named apart from the models'
    /// series it adds after them: responses by status and connections.
    pub fn render_front(&self) -> String {
        let mut out = String::new();
        sample(
            &mut out,
            "torus_front_http_connections",
            "gauge",
            "Open HTTP connections to the models server.",
            "",
            self.connections.load(Relaxed).to_string(),
        );
        self.render_statuses(
            &mut out,
            "torus_front_requests_total",
            "The models server's HTTP responses by status code.",
        );
        out
    }

    /// vLLM's families (names, units and labels as vLLM exports them), from the same numbers as
    /// the `torus_*` ones: only where the meaning is the same.
    fn render_vllm(&self, out: &mut String, engine: Option<&MetricsSnapshot>, v: &VllmLabels) {
        let labels = format!("engine=\"0\",model_name=\"{}\"", escape_label(&v.model_name));
        let one = |out: &mut String, name: &str, kind: &str, help: &str, value: String| {
            sample(out, name, kind, help, &labels, value)
        };
        if let Some(m) = engine {
            let usage = if m.kv_blocks_total == 0 { 0.0 } else { m.kv_blocks_used as f64 / m.kv_blocks_total as f64 };
            one(
                out,
                "vllm:num_requests_running",
                "gauge",
                "Number of requests in model execution batches.",
                m.running.to_string(),
            );
            one(
                out,
                "vllm:num_requests_waiting",
                "gauge",
                "Number of requests waiting to be processed.",
                m.waiting.to_string(),
            );
            one(
                out,
                "vllm:kv_cache_usage_perc",
                "gauge",
                "KV-cache usage. 1 means 100 percent usage.",
                usage.to_string(),
            );
            one(
                out,
                "vllm:gpu_cache_usage_perc",
                "gauge",
                "GPU KV-cache usage. 1 means 100 percent usage (the older name of vllm:kv_cache_usage_perc).",
                usage.to_string(),
            );
            one(
                out,
                "vllm:prefix_cache_queries_total",
                "counter",
                "Prefix cache queries, in terms of number of queried tokens.",
                m.prefix_query_tokens.to_string(),
            );
            one(
                out,
                "vllm:prefix_cache_hits_total",
                "counter",
                "Prefix cache hits, in terms of number of cached tokens.",
                m.prefix_hit_tokens.to_string(),
            );
            one(
                out,
                "vllm:num_preemptions_total",
                "counter",
                "Cumulative number of preemptions.",
                m.preemptions.to_string(),
            );
            for (name, help, value) in [
                ("vllm:spec_decode_num_drafts_total", "Number of spec decoding drafts.", m.spec_drafts),
                ("vllm:spec_decode_num_draft_tokens_total", "Number of draft tokens.", m.spec_draft_tokens),
                ("vllm:spec_decode_num_accepted_tokens_total", "Number of accepted tokens.", m.spec_accepted_tokens),
            ] {
                one(out, name, "counter", help, value.to_string());
            }
            let name = "vllm:spec_decode_num_accepted_tokens_per_pos_total";
            let _ = writeln!(out, "# HELP {name} Accepted tokens per draft position.\n# TYPE {name} counter");
            for (pos, n) in m.spec_accepted_per_pos.iter().enumerate() {
                let _ = writeln!(out, "{name}{{{labels},position=\"{pos}\"}} {n}");
            }
            let _ = writeln!(
                out,
                "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig.\n\
                 # TYPE vllm:cache_config_info gauge\n\
                 vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"{}\",enable_prefix_caching=\"{}\",\
                 engine=\"0\",num_gpu_blocks=\"{}\"}} 1.0",
                v.block_size,
                v.cache_dtype,
                if v.prefix_caching { "True" } else { "False" },
                m.kv_blocks_total,
            );
        }
        one(
            out,
            "vllm:prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed (finished sequences; each choice counts its prompt).",
            self.prompt_tokens.load(Relaxed).to_string(),
        );
        one(
            out,
            "vllm:generation_tokens_total",
            "counter",
            "Number of generation tokens processed (finished sequences).",
            self.generation_tokens.load(Relaxed).to_string(),
        );
        let _ = writeln!(
            out,
            "# HELP vllm:request_success_total Count of successfully processed requests.\n\
             # TYPE vllm:request_success_total counter"
        );
        if let Ok(m) = self.finished.lock() {
            for reason in ["stop", "length", "abort", "error"] {
                let n = m.get(reason).copied().unwrap_or(0);
                let _ = writeln!(out, "vllm:request_success_total{{{labels},finished_reason=\"{reason}\"}} {n}");
            }
        }
        let hist = |out: &mut String, h: &Mutex<Histogram>, name: &str, help: &str| {
            if let Ok(h) = h.lock() {
                h.render(out, name, help, &labels);
            }
        };
        hist(out, &self.ttft, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.");
        hist(out, &self.itl, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.");
        hist(
            out,
            &self.itl,
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds (the older name of vllm:inter_token_latency_seconds).",
        );
        hist(out, &self.e2e, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.");
        hist(out, &self.request_prompt_tokens, "vllm:request_prompt_tokens", "Number of prefill tokens processed.");
        hist(
            out,
            &self.request_generation_tokens,
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
        );
    }
}

/// What the vLLM-named families need besides the counters.
#[derive(Clone, Debug, Default)]
pub struct VllmLabels {
    /// The served model name (the first `--served-model-name`).
    pub model_name: String,
    pub block_size: usize,
    /// `auto` (f16) or `fp32`, as vLLM names the KV-cache dtype.
    pub cache_dtype: String,
    pub prefix_caching: bool,
}

/// One sample with its HELP and TYPE lines; `labels` (`a="x",b="y"`) may be empty.
fn sample(out: &mut String, name: &str, kind: &str, help: &str, labels: &str, value: String) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{} {value}", braced(labels));
}

/// `{labels}`, or nothing for no labels.
fn braced(labels: &str) -> String {
    if labels.is_empty() {
        String::new()
    } else {
        format!("{{{labels}}}")
    }
}

/// A Prometheus label value: backslash, quote and newline escaped.
fn escape_label(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        for s in [0.05, 0.1, 0.5, 3.0] {
            h.observe(s);
        }
        let mut out = String::new();
        h.render(&mut out, "x", "help", "");
        assert!(out.contains("x_bucket{le=\"0.1\"} 2\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"1\"} 3\n"), "{out}");
        assert!(out.contains("x_bucket{le=\"+Inf\"} 4\n"), "{out}");
        assert!(out.contains("x_count 4\n"), "{out}");
    }
}
