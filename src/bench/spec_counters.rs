//! Speculative decoding's counters as a server exports them on `/metrics` under vLLM's names
//! (`vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`,
//! `..._num_accepted_tokens_total`, `..._num_accepted_tokens_per_pos_total{position}`), read
//! before and after a benchmark run so its report shows what speculation did during it. A
//! server without them (or without `/metrics`) shows nothing.

use serde::Serialize;

/// The counters (summed over label sets other than `position`), or their growth over a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SpecCounters {
    pub drafts: f64,
    pub draft_tokens: f64,
    pub accepted_tokens: f64,
    /// Accepted tokens by position in their proposal.
    pub accepted_per_position: Vec<f64>,
}

const PREFIX: &str = "vllm:spec_decode_num_";

impl SpecCounters {
    /// The counters in a Prometheus text exposition; None when it has none of them.
    pub fn parse(text: &str) -> Option<SpecCounters> {
        let mut c = SpecCounters::default();
        let mut seen = false;
        for line in text.lines().filter(|l| l.starts_with(PREFIX)) {
            let Some((series, value)) = line.rsplit_once(' ') else { continue };
            let Ok(v) = value.trim().parse::<f64>() else { continue };
            let name = series.split('{').next().unwrap_or(series);
            seen = true;
            match &name[PREFIX.len()..] {
                "drafts_total" => c.drafts += v,
                "draft_tokens_total" => c.draft_tokens += v,
                "accepted_tokens_total" => c.accepted_tokens += v,
                "accepted_tokens_per_pos_total" => {
                    let pos = series
                        .split("position=\"")
                        .nth(1)
                        .and_then(|r| r.split('"').next())
                        .and_then(|p| p.parse::<usize>().ok());
                    if let Some(p) = pos.filter(|&p| p < 64) {
                        if c.accepted_per_position.len() <= p {
                            c.accepted_per_position.resize(p + 1, 0.0);
                        }
                        c.accepted_per_position[p] += v;
                    }
                }
                _ => {}
            }
        }
        seen.then_some(c)
    }

    /// What grew from `before` to `self`.
    pub fn since(&self, before: &SpecCounters) -> SpecCounters {
        let at = |v: &[f64], i: usize| v.get(i).copied().unwrap_or(0.0);
        SpecCounters {
            drafts: self.drafts - before.drafts,
            draft_tokens: self.draft_tokens - before.draft_tokens,
            accepted_tokens: self.accepted_tokens - before.accepted_tokens,
            accepted_per_position: (0..self.accepted_per_position.len())
                .map(|i| at(&self.accepted_per_position, i) - at(&before.accepted_per_position, i))
                .collect(),
        }
    }

    /// Accepted of proposed tokens.
    pub fn acceptance_rate(&self) -> f64 {
        if self.draft_tokens > 0.0 {
            self.accepted_tokens / self.draft_tokens
        } else {
            0.0
        }
    }

    /// Tokens a verification yields on average: its accepted proposals and the one after them.
    pub fn mean_accepted_length(&self) -> f64 {
        if self.drafts > 0.0 {
            1.0 + self.accepted_tokens / self.drafts
        } else {
            0.0
        }
    }
}

/// The server's counters now (None without /metrics or without speculative counters, or when
/// it does not answer within 10 s).
pub async fn scrape(client: &reqwest::Client, base_url: &str, api_key: Option<&str>) -> Option<SpecCounters> {
    let url = format!("{}/metrics", base_url.trim_end_matches('/'));
    let mut req = client.get(url).timeout(std::time::Duration::from_secs(10));
    if let Some(k) = api_key {
        req = req.bearer_auth(k);
    }
    let resp = req.send().await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    SpecCounters::parse(&resp.text().await.ok()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_subtracts() {
        let text = "# HELP vllm:spec_decode_num_drafts_total x\n\
                    vllm:spec_decode_num_drafts_total{engine=\"0\",model_name=\"m\"} 10\n\
                    vllm:spec_decode_num_draft_tokens_total{engine=\"0\",model_name=\"m\"} 40\n\
                    vllm:spec_decode_num_accepted_tokens_total{engine=\"0\",model_name=\"m\"} 25.0\n\
                    vllm:spec_decode_num_accepted_tokens_per_pos_total{engine=\"0\",model_name=\"m\",position=\"0\"} 9\n\
                    vllm:spec_decode_num_accepted_tokens_per_pos_total{engine=\"0\",model_name=\"m\",position=\"1\"} 8\n\
                    vllm:num_requests_running 3\n";
        let c = SpecCounters::parse(text).unwrap();
        assert_eq!((c.drafts, c.draft_tokens, c.accepted_tokens), (10.0, 40.0, 25.0));
        assert_eq!(c.accepted_per_position, vec![9.0, 8.0]);
        assert_eq!(c.acceptance_rate(), 0.625);
        assert_eq!(c.mean_accepted_length(), 3.5);
        let d = c.since(&SpecCounters {
            drafts: 4.0,
            draft_tokens: 10.0,
            accepted_tokens: 5.0,
            accepted_per_position: vec![3.0],
        });
        assert_eq!((d.drafts, d.draft_tokens, d.accepted_tokens), (6.0, 30.0, 20.0));
        assert_eq!(d.accepted_per_position, vec![6.0, 8.0]);
        assert!(SpecCounters::parse("vllm:num_requests_running 3\n").is_none());
    }
}
