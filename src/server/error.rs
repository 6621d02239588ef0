//! Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the status
//! that goes with them; the same errors in Anthropic's and Ollama's shapes for their routes
//! ([`Dialect`]).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: invalid_request_error, authentication_error, server_error, ...
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (503).
    pub retry_after: Option<u32>,
    /// A prompt that does not fit: (its tokens, the context), as llama-server reports them
    /// (`n_prompt_tokens`, `n_ctx` beside OpenAI's fields; llama.cpp's web UI reads them).
    pub context: Option<(usize, usize)>,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, message: message.into(), kind, param: None, code: None, retry_after: None, context: None }
    }

    /// 400, naming the request field at fault.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message).param(param)
    }

    /// 400 about the request as a whole (malformed JSON, invalid UTF-8).
    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn unauthorized(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "invalid_request_error", message).code("invalid_api_key")
    }

    /// 403: the request may not be answered here (a host the server does not serve).
    pub fn forbidden(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::FORBIDDEN, "invalid_request_error", message)
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", message).code("not_found")
    }

    pub fn model_not_found(name: &str) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "invalid_request_error", format!("The model `{name}` does not exist."))
            .param("model")
            .code("model_not_found")
    }

    pub fn method_not_allowed() -> ApiError {
        ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "invalid_request_error", "method not allowed for this route")
            .code("method_not_allowed")
    }

    pub fn too_large(limit: usize) -> ApiError {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request body is larger than {limit} bytes"),
        )
        .code("request_too_large")
    }

    /// 415: POST bodies must be declared JSON.
    pub fn unsupported_media_type(got: Option<&str>) -> ApiError {
        let got = match got {
            Some(ct) => format!("got {:?}", ct.chars().take(100).collect::<String>()),
            None => "got none".to_string(),
        };
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "invalid_request_error",
            format!("the request body must be JSON, sent with `Content-Type: application/json` ({got})"),
        )
        .code("unsupported_media_type")
    }

    /// 408: the body did not all arrive within `--body-read-timeout-s`.
    pub fn body_timed_out(limit: std::time::Duration) -> ApiError {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "timeout_error",
            format!("the request body did not arrive within {} s (body_read_timeout_s)", limit.as_secs_f64()),
        )
        .code("body_timeout")
    }

    /// 503 with Retry-After.
    pub fn unavailable(message: impl Into<String>, code: &'static str) -> ApiError {
        let mut e = ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message).code(code);
        e.retry_after = Some(1);
        e
    }

    /// 408: the request ran past its time limit (`request_timeout_s`) and was aborted.
    pub fn timed_out(limit: std::time::Duration) -> ApiError {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "timeout_error",
            format!(
                "the request did not finish within its time limit of {} s (request_timeout_s) and was aborted",
                limit.as_secs_f64()
            ),
        )
        .code("request_timeout")
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn param(mut self, param: &str) -> ApiError {
        self.param = Some(param.to_string());
        self
    }

    pub fn code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    pub fn body(&self) -> Value {
        let mut v = json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        });
        if let Some((prompt, ctx)) = self.context {
            v["error"]["n_prompt_tokens"] = json!(prompt);
            v["error"]["n_ctx"] = json!(ctx);
        }
        v
    }

    /// With the prompt's length and the context (see [`ApiError::context`]).
    pub fn with_context(mut self, prompt_tokens: usize, ctx: usize) -> ApiError {
        self.context = Some((prompt_tokens, ctx));
        self
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.status, self.message)
    }
}

/// Whose error shape a route answers in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// `{"error": {"message", "type", "param", "code"}}`.
    OpenAi,
    /// `{"type": "error", "error": {"type", "message"}}` (`/v1/messages`).
    Anthropic,
    /// `{"error": "message"}` (`/api/...`).
    Ollama,
}

impl Dialect {
    /// The dialect of the route at `path`.
    pub fn of_path(path: &str) -> Dialect {
        if path == "/v1/messages" || path.starts_with("/v1/messages/") {
            Dialect::Anthropic
        } else if path == "/api" || path.starts_with("/api/") {
            Dialect::Ollama
        } else {
            Dialect::OpenAi
        }
    }
}

impl ApiError {
    /// Anthropic's error type for this error's status.
    pub fn anthropic_type(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            408 => "timeout_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 => "overloaded_error",
            s if s >= 500 => "api_error",
            _ => "invalid_request_error",
        }
    }

    /// The body in `d`'s shape.
    pub fn body_in(&self, d: Dialect) -> Value {
        match d {
            Dialect::OpenAi => self.body(),
            Dialect::Anthropic => json!({
                "type": "error",
                "error": {"type": self.anthropic_type(), "message": self.message},
            }),
            Dialect::Ollama => json!({"error": self.message}),
        }
    }

    /// The response in `d`'s shape.
    pub fn response_in(self, d: Dialect) -> Response {
        let mut r = (self.status, axum::Json(self.body_in(d))).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.response_in(Dialect::OpenAi)
    }
}
