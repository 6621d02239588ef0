//! Reading OpenAI request bodies: every field is checked for its type and range, and an error
//! names the field (`param`). Fields the server does not know are ignored, as OpenAI clients
//! send extras; `null` counts as absent.

use super::error::ApiError;
use crate::engine::{RequestParams, StopConditions};
use crate::sampling::SamplingParams;
use crate::tokenizer::ChatMessage;
use serde_json::Value;
use std::time::Duration;

pub(crate) use super::fields::type_name;
pub use super::fields::Fields;
use super::fields::{as_int, wrong_type};

/// Most `logit_bias` entries per request.
pub const MAX_LOGIT_BIAS: usize = crate::sampling::MAX_LOGIT_BIAS;
/// Most stop strings per request.
pub const MAX_STOP: usize = 16;
/// The most stop strings an Ollama request may hold (each costs a scan per token).
pub const OLLAMA_MAX_STOP: usize = 128;
/// The largest temperature an Ollama request may ask for (past ~10 sampling is uniform anyway).
pub const OLLAMA_MAX_TEMPERATURE: f64 = 100.0;
/// Longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 1024;
/// Most `stop_token_ids` per request.
pub const MAX_STOP_TOKEN_IDS: usize = 64;
/// Most top logprobs per token (the engine's limit).
pub const MAX_TOP_LOGPROBS: u32 = crate::sampling::row::MAX_TOP_LOGPROBS as u32;

/// What the server was started with that request parsing needs.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub vocab: usize,
    pub max_n: usize,
    pub default_temperature: f32,
    pub default_top_p: f32,
    pub default_top_k: u32,
    /// The server's `request_timeout_s` (None: no limit).
    pub request_timeout: Option<Duration>,
    /// The largest `temperature` (2, as OpenAI; Ollama's clients send more).
    pub max_temperature: f64,
    /// The most `stop` strings ([`MAX_STOP`], as OpenAI; Ollama's clients send more).
    pub max_stop: usize,
}

impl Limits {
    /// Ollama's: any temperature up to [`OLLAMA_MAX_TEMPERATURE`] and up to
    /// [`OLLAMA_MAX_STOP`] stop strings (Ollama refuses neither).
    pub fn ollama(self) -> Limits {
        Limits { max_temperature: OLLAMA_MAX_TEMPERATURE, max_stop: OLLAMA_MAX_STOP, ..self }
    }
}

/// The sampling and stopping fields both endpoints share.
#[derive(Clone, Debug)]
pub struct Common {
    pub model: Option<String>,
    /// Prefix-cache salt (see RequestParams::cache_salt).
    pub cache_salt: Option<String>,
    pub max_tokens: Option<usize>,
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    /// llama-server's `timings_per_token`: `timings` on the response (and on every chunk).
    pub timings: bool,
    /// llama-server's `return_progress`: `prompt_progress` chunks while the prompt is computed.
    pub progress: bool,
    pub sampling: SamplingParams,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub logit_bias: Vec<(u32, f32)>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// The request's time limit: its own `request_timeout_s` (at most the server's), or the
    /// server's.
    pub timeout: Option<Duration>,
    /// Structured outputs: the constraint asked for, and once compiled, the compiled one (each
    /// choice gets its own copy).
    pub constraint: Option<super::structured::Requested>,
    pub compiled: Option<crate::structured::Constraint>,
    /// The server's reasoning parser (chat splits its output with it).
    pub reasoning: super::reasoning::ReasoningChoice,
    /// `max_tokens` past the room the prompt leaves is cut to it (the translated APIs, whose
    /// clients ask for 8k-32k and expect a "max tokens" end), not a 400 (OpenAI's routes, as
    /// vLLM).
    pub clamp_max_tokens: bool,
}

impl Common {
    /// `max_tokens_keys`: the accepted names, the first present wins.
    pub fn parse(f: &Fields, lim: &Limits, max_tokens_keys: &[&str]) -> Result<Common, ApiError> {
        let model = f.string("model")?.map(str::to_string);
        let mut max_tokens = None;
        for k in max_tokens_keys {
            if let Some(m) = f.int_in(k, 1, i64::MAX)? {
                max_tokens.get_or_insert(usize::try_from(m).unwrap_or(usize::MAX));
            }
        }
        let n = f.int_in("n", 1, lim.max_n as i64)?.unwrap_or(1) as usize;
        let stream = f.bool("stream")?.unwrap_or(false);
        let include_usage = match f.get("stream_options") {
            None => false,
            Some(Value::Object(o)) => {
                if !stream {
                    return Err(ApiError::invalid(
                        "stream_options",
                        "`stream_options` is only allowed when `stream` is true",
                    ));
                }
                let o = Fields(o);
                o.bool("include_usage").map_err(|e| e.param("stream_options.include_usage"))?.unwrap_or(false)
            }
            Some(v) => return Err(wrong_type("stream_options", "an object", v)),
        };
        let timings = f.bool("timings_per_token")?.unwrap_or(false);
        let progress = f.bool("return_progress")?.unwrap_or(false);
        let temperature =
            f.float_in("temperature", 0.0, lim.max_temperature, false)?.unwrap_or(lim.default_temperature);
        let top_p = f.float_in("top_p", 0.0, 1.0, true)?.unwrap_or(lim.default_top_p);
        // vLLM's and llama.cpp's min_p: 0 (the default) is off.
        let min_p = f.float_in("min_p", 0.0, 1.0, false)?.unwrap_or(0.0);
        // -1, 0 and anything from the vocabulary size up mean no top-k cut.
        let top_k = f.int_in("top_k", -1, i64::MAX)?.map_or(lim.default_top_k, |k| {
            if k <= 0 || k >= lim.vocab as i64 {
                0
            } else {
                k as u32
            }
        });
        // Any 64-bit integer, signed or not (a negative seed wraps).
        let seed = match f.get("seed") {
            None => None,
            Some(v @ Value::Number(n)) => Some(
                n.as_u64()
                    .or_else(|| as_int(v).map(|s| s as u64))
                    .ok_or_else(|| ApiError::invalid("seed", format!("`seed` must be a 64-bit integer, got {n}")))?,
            ),
            Some(v) => return Err(wrong_type("seed", "an integer", v)),
        };
        let frequency_penalty = f.float_in("frequency_penalty", -2.0, 2.0, false)?.unwrap_or(0.0);
        let presence_penalty = f.float_in("presence_penalty", -2.0, 2.0, false)?.unwrap_or(0.0);
        let repetition_penalty = f.float_in("repetition_penalty", 0.0, 10.0, true)?.unwrap_or(1.0);
        let logit_bias = parse_logit_bias(f.get("logit_bias"), lim.vocab)?;
        let stop = parse_stop(f.get("stop"), lim.max_stop)?;
        let stop_token_ids = match f.get("stop_token_ids") {
            None => vec![],
            Some(Value::Array(a)) if a.len() > MAX_STOP_TOKEN_IDS => {
                return Err(ApiError::invalid(
                    "stop_token_ids",
                    format!("`stop_token_ids` may hold at most {MAX_STOP_TOKEN_IDS} token ids, got {}", a.len()),
                ))
            }
            Some(v) => token_ids(v, "stop_token_ids", lim.vocab)?,
        };
        let ignore_eos = f.bool("ignore_eos")?.unwrap_or(false);
        // vLLM's prefix-cache salt: only requests with the same salt share cached blocks.
        let cache_salt = f.string("cache_salt")?.map(str::to_string);
        if cache_salt.as_ref().is_some_and(|s| s.is_empty() || s.len() > 1024) {
            return Err(ApiError::invalid(
                "cache_salt",
                "`cache_salt` must be a non-empty string of at most 1024 bytes",
            ));
        }
        let timeout = match f.number("request_timeout_s")? {
            None => lim.request_timeout,
            Some(x) => {
                let d = Duration::try_from_secs_f64(x).ok().filter(|d| !d.is_zero()).ok_or_else(|| {
                    ApiError::invalid(
                        "request_timeout_s",
                        format!("`request_timeout_s` must be a positive number of seconds, got {x}"),
                    )
                })?;
                match lim.request_timeout {
                    Some(max) if d > max => {
                        return Err(ApiError::invalid(
                            "request_timeout_s",
                            format!(
                                "`request_timeout_s` may be at most the server's limit of {} s, got {x}",
                                max.as_secs_f64()
                            ),
                        ))
                    }
                    _ => Some(d),
                }
            }
        };
        // Structured outputs: compiled later (`structured::compile`), off the async threads.
        let constraint = super::structured::parse(f)?;
        Ok(Common {
            clamp_max_tokens: false,
            model,
            max_tokens,
            n,
            stream,
            include_usage,
            timings,
            progress,
            sampling: SamplingParams { temperature, top_p, top_k, min_p, seed },
            repetition_penalty,
            frequency_penalty,
            presence_penalty,
            logit_bias,
            stop,
            stop_token_ids,
            ignore_eos,
            cache_salt,
            timeout,
            constraint,
            compiled: None,
            reasoning: Default::default(),
        })
    }

    /// The engine parameters of choice `j` (of n): choice 0 keeps the request's seed, the others
    /// derive their own from it so that n seeded choices differ but are reproducible.
    pub fn request_params(&self, j: usize, max_tokens: usize, logprobs: Option<u32>) -> RequestParams {
        let mut sampling = self.sampling;
        if j > 0 {
            sampling.seed = sampling.seed.map(|s| crate::sampling::Rng::new(s ^ (j as u64).rotate_left(32)).next_u64());
        }
        RequestParams {
            sampling,
            repetition_penalty: self.repetition_penalty,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            logit_bias: self.logit_bias.clone(),
            logprobs,
            stop: StopConditions {
                max_tokens: Some(max_tokens),
                stop_token_ids: self.stop_token_ids.clone(),
                stop: self.stop.clone(),
                ignore_eos: self.ignore_eos,
            },
            prompt_logprobs: None,
            cache_salt: self.cache_salt.clone(),
            skip_special_tokens: true,
            constraint: self.compiled.clone(),
            constraint_after: None,
            pooling: None,
            progress: self.timings || self.progress,
        }
    }
}

fn parse_logit_bias(v: Option<&Value>, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(v) = v else { return Ok(vec![]) };
    let Value::Object(map) = v else { return Err(wrong_type("logit_bias", "an object", v)) };
    if map.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid("logit_bias", format!("`logit_bias` may hold at most {MAX_LOGIT_BIAS} tokens")));
    }
    let mut out = Vec::with_capacity(map.len());
    for (k, b) in map {
        let id: u32 = k
            .trim()
            .parse()
            .map_err(|_| ApiError::invalid("logit_bias", format!("`logit_bias` keys must be token ids, got {k:?}")))?;
        if id as usize >= vocab {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("`logit_bias` token id {id} is outside the vocabulary (size {vocab})"),
            ));
        }
        let bias = b.as_f64().ok_or_else(|| wrong_type("logit_bias", "an object of numbers", b))?;
        if !(-100.0..=100.0).contains(&bias) {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("`logit_bias` values must be in [-100, 100], got {bias}"),
            ));
        }
        out.push((id, bias as f32));
    }
    Ok(out)
}

fn parse_stop(v: Option<&Value>, max: usize) -> Result<Vec<String>, ApiError> {
    let list: Vec<&Value> = match v {
        None => return Ok(vec![]),
        Some(Value::String(_)) => vec![v.expect("matched Some")],
        Some(Value::Array(a)) => a.iter().collect(),
        Some(v) => return Err(wrong_type("stop", "a string or an array of strings", v)),
    };
    if list.len() > max {
        return Err(ApiError::invalid("stop", format!("`stop` may hold at most {max} strings, got {}", list.len())));
    }
    list.into_iter()
        .map(|s| match s {
            Value::String(s) if s.is_empty() => Err(ApiError::invalid("stop", "`stop` strings must not be empty")),
            Value::String(s) if s.len() > MAX_STOP_BYTES => Err(ApiError::invalid(
                "stop",
                format!("`stop` strings may be at most {MAX_STOP_BYTES} bytes long, got one of {} bytes", s.len()),
            )),
            Value::String(s) => Ok(s.clone()),
            v => Err(wrong_type("stop", "a string or an array of strings", v)),
        })
        .collect()
}

/// A non-empty array of token ids below `vocab`.
fn token_ids(v: &Value, param: &str, vocab: usize) -> Result<Vec<u32>, ApiError> {
    let Value::Array(a) = v else { return Err(wrong_type(param, "an array of token ids", v)) };
    a.iter()
        .map(|x| {
            let id = as_int(x).ok_or_else(|| wrong_type(param, "an array of integer token ids", x))?;
            if id < 0 || id as u64 >= vocab as u64 {
                return Err(ApiError::invalid(
                    param,
                    format!("token id {id} in `{param}` is outside the vocabulary (size {vocab})"),
                ));
            }
            Ok(id as u32)
        })
        .collect()
}

/// Chat messages: `role` and `content` (a string, null, or a list of text parts), and the
/// tool-calling fields (`tool_calls`, `tool_call_id`, `name`; see `tools::parse_history_fields`).
pub fn parse_messages(v: Option<&Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let Some(v) = v else { return Err(ApiError::invalid("messages", "`messages` is required")) };
    let Value::Array(list) = v else { return Err(wrong_type("messages", "an array", v)) };
    if list.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` must not be empty"));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let p = format!("messages[{i}]");
            let Value::Object(o) = m else { return Err(wrong_type(&p, "an object", m)) };
            let f = Fields(o);
            let role = f.string("role").map_err(|e| e.param(&format!("{p}.role")))?;
            let role = match role {
                Some("developer") => "system",
                Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
                Some(r) => {
                    return Err(ApiError::invalid(
                        &format!("{p}.role"),
                        format!("unknown role {r:?} (system, developer, user, assistant or tool)"),
                    ))
                }
                None => return Err(ApiError::invalid(&format!("{p}.role"), format!("`{p}.role` is required"))),
            };
            let pc = format!("{p}.content");
            let content = match f.get("content") {
                None => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let mut text = String::new();
                    for part in parts {
                        let t = match part {
                            Value::String(s) => Some(s.as_str()),
                            Value::Object(po) if po.get("type").and_then(Value::as_str) == Some("text") => {
                                po.get("text").and_then(Value::as_str)
                            }
                            _ => None,
                        };
                        let Some(t) = t else {
                            return Err(ApiError::invalid(&pc, "only text content parts are supported"));
                        };
                        text.push_str(t);
                    }
                    text
                }
                Some(v) => return Err(wrong_type(&pc, "a string or an array of text parts", v)),
            };
            let mut msg = ChatMessage::new(role, content);
            super::tools::parse_history_fields(&f, &p, &mut msg)?;
            // The thinking of an earlier answer, given back (vLLM's `reasoning_content`, or
            // `reasoning`): the template decides whether it shows it (Qwen3's show only the
            // current tool-use cycle's).
            for key in ["reasoning_content", "reasoning"] {
                match f.get(key) {
                    None | Some(Value::Null) => {}
                    Some(Value::String(s)) if role == "assistant" => msg.reasoning_content = Some(s.clone()),
                    Some(Value::String(_)) => {
                        let pk = format!("{p}.{key}");
                        return Err(ApiError::invalid(&pk, format!("only assistant messages may have `{key}`")));
                    }
                    Some(v) => return Err(wrong_type(&format!("{p}.{key}"), "a string", v)),
                }
            }
            Ok(msg)
        })
        .collect()
}

/// A completions prompt: text, or token ids (read by `body`, as the body is parsed).
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn lim() -> Limits {
        Limits {
            vocab: 100,
            max_n: 4,
            default_temperature: 0.5,
            default_top_p: 0.9,
            default_top_k: 7,
            request_timeout: Some(Duration::from_secs(10)),
            max_temperature: 2.0,
            max_stop: MAX_STOP,
        }
    }

    #[test]
    fn ollamas_limits_take_more_stops_and_hotter_temperatures() {
        let body = json!({"temperature": 5.0, "stop": vec!["a"; MAX_STOP + 4]});
        let f = Fields(body.as_object().unwrap());
        let e = Common::parse(&f, &lim(), &["max_tokens"]).unwrap_err();
        assert!(e.message.contains("temperature"), "{}", e.message);
        let c = Common::parse(&f, &lim().ollama(), &["max_tokens"]).unwrap();
        assert_eq!((c.sampling.temperature, c.stop.len()), (5.0, MAX_STOP + 4));
        let body = json!({"temperature": 101, "stop": vec!["a"; OLLAMA_MAX_STOP + 1]});
        let f = Fields(body.as_object().unwrap());
        assert!(Common::parse(&f, &lim().ollama(), &["max_tokens"]).is_err());
        let body = json!({"stop": vec!["a"; OLLAMA_MAX_STOP + 1]});
        let e = Common::parse(&Fields(body.as_object().unwrap()), &lim().ollama(), &["max_tokens"]).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop"));
    }

    fn common(v: Value) -> Result<Common, ApiError> {
        Common::parse(&Fields(v.as_object().unwrap()), &lim(), &["max_completion_tokens", "max_tokens"])
    }

    #[test]
    fn defaults_come_from_the_config() {
        let c = common(json!({})).unwrap();
        assert_eq!(c.cache_salt, None);
        assert_eq!(
            common(json!({"cache_salt": "t1"})).unwrap().request_params(0, 4, None).cache_salt.as_deref(),
            Some("t1")
        );
        assert_eq!((c.sampling.temperature, c.sampling.top_p, c.sampling.top_k), (0.5, 0.9, 7));
        assert_eq!((c.n, c.max_tokens, c.stream), (1, None, false));
        let c = common(json!({"temperature": null, "top_k": -1, "max_tokens": 5, "max_completion_tokens": 3})).unwrap();
        assert_eq!((c.sampling.temperature, c.sampling.top_k, c.max_tokens), (0.5, 0, Some(3)));
        assert_eq!(c.sampling.min_p, 0.0, "min_p is off by default");
        for x in [0.0, 0.05, 1.0] {
            assert_eq!(common(json!({ "min_p": x })).unwrap().request_params(0, 4, None).sampling.min_p, x as f32);
        }
    }

    #[test]
    fn each_bad_field_is_named() {
        for (body, param) in [
            (json!({"temperature": 2.5}), "temperature"),
            (json!({"temperature": "hot"}), "temperature"),
            (json!({"top_p": 0}), "top_p"),
            (json!({"min_p": -0.1}), "min_p"),
            (json!({"min_p": 1.5}), "min_p"),
            (json!({"min_p": "0.1"}), "min_p"),
            (json!({"n": 5}), "n"),
            (json!({"n": 1.5}), "n"),
            (json!({"max_tokens": 0}), "max_tokens"),
            (json!({"logit_bias": {"x": 1}}), "logit_bias"),
            (json!({"logit_bias": {"100": 1}}), "logit_bias"),
            (json!({"logit_bias": {"3": 101}}), "logit_bias"),
            (json!({"stop": [""]}), "stop"),
            (json!({"stop": 3}), "stop"),
            (json!({"stream_options": {"include_usage": true}}), "stream_options"),
            (json!({"stream": true, "stream_options": {"include_usage": 1}}), "stream_options.include_usage"),
            (json!({"presence_penalty": -3}), "presence_penalty"),
            (json!({"seed": "x"}), "seed"),
            (json!({"cache_salt": 5}), "cache_salt"),
            (json!({"cache_salt": ""}), "cache_salt"),
            (json!({"cache_salt": "x".repeat(1025)}), "cache_salt"),
            (json!({"stop": vec!["a"; MAX_STOP + 1]}), "stop"),
            (json!({"stop": "x".repeat(MAX_STOP_BYTES + 1)}), "stop"),
            (json!({"stop": ["ok", "é".repeat(MAX_STOP_BYTES / 2 + 1)]}), "stop"),
            (json!({"stop_token_ids": vec![1; MAX_STOP_TOKEN_IDS + 1]}), "stop_token_ids"),
            (json!({"stop_token_ids": [100]}), "stop_token_ids"),
            (json!({"stop_token_ids": 3}), "stop_token_ids"),
            (json!({"n": 1e20}), "n"),
            (json!({"max_tokens": -1e300}), "max_tokens"),
            (json!({"seed": 1.5}), "seed"),
            (json!({"seed": 1e20}), "seed"),
            (json!({"seed": [1]}), "seed"),
            (json!({"top_k": 1e19}), "top_k"),
            (json!({"request_timeout_s": 0}), "request_timeout_s"),
            (json!({"request_timeout_s": -1}), "request_timeout_s"),
            (json!({"request_timeout_s": 11}), "request_timeout_s"),
            (json!({"request_timeout_s": 1e300}), "request_timeout_s"),
            (json!({"request_timeout_s": "5"}), "request_timeout_s"),
        ] {
            let e = common(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e}");
            assert_eq!(e.status, 400);
        }
    }

    #[test]
    fn limits_accept_their_bounds() {
        let c = common(json!({
            "stop": vec!["s".repeat(MAX_STOP_BYTES); MAX_STOP],
            "stop_token_ids": vec![99; MAX_STOP_TOKEN_IDS],
            "seed": u64::MAX,
            "request_timeout_s": 0.25,
        }))
        .unwrap();
        assert_eq!((c.stop.len(), c.stop_token_ids.len()), (MAX_STOP, MAX_STOP_TOKEN_IDS));
        assert_eq!(c.sampling.seed, Some(u64::MAX));
        assert_eq!(c.timeout, Some(Duration::from_millis(250)));
        assert_eq!(common(json!({"seed": -1})).unwrap().sampling.seed, Some(u64::MAX));
        assert_eq!(common(json!({})).unwrap().timeout, Some(Duration::from_secs(10)));
        let unlimited = Limits { request_timeout: None, ..lim() };
        let f = json!({"request_timeout_s": 1e6});
        let c = Common::parse(&Fields(f.as_object().unwrap()), &unlimited, &["max_tokens"]).unwrap();
        assert_eq!(c.timeout, Some(Duration::from_secs(1_000_000)));
    }

    #[test]
    fn messages() {
        let m = parse_messages(Some(&json!([{"role": "developer", "content": [{"type": "text", "text": "a"}, "b"]}])))
            .unwrap();
        assert_eq!(m, vec![ChatMessage::new("system", "ab")]);
        for bad in [json!([]), json!("hi"), json!([{"content": "x"}]), json!([{"role": "user", "content": 5}])] {
            assert!(parse_messages(Some(&bad)).is_err(), "{bad}");
        }
    }
}
