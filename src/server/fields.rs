//! The fields of one JSON request object, read by type: each reader checks the field's type
//! (and range), and an error names the field (`param`); `null` counts as absent.

use super::error::ApiError;
use serde_json::{Map, Value};

/// The fields of one JSON object.
pub struct Fields<'a>(pub &'a Map<String, Value>);

pub(crate) fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

pub(super) fn wrong_type(param: &str, want: &str, got: &Value) -> ApiError {
    ApiError::invalid(param, format!("`{param}` must be {want}, got {}", type_name(got)))
}

/// The error for a value that is not an integer (or one too large to be meant).
fn not_an_int(param: &str, v: &Value) -> ApiError {
    match v {
        Value::Number(n) => ApiError::invalid(param, format!("`{param}` must be an integer, got {n}")),
        _ => wrong_type(param, "an integer", v),
    }
}

/// An integer from a JSON number (2.0 counts; 2.5 does not).
pub(super) fn as_int(v: &Value) -> Option<i64> {
    match v {
        Value::Number(n) => n.as_i64().or_else(|| {
            let f = n.as_f64()?;
            (f.fract() == 0.0 && f.abs() < 9.0e15).then_some(f as i64)
        }),
        _ => None,
    }
}

impl<'a> Fields<'a> {
    /// The field, unless it is missing or null.
    /// `chat_template_kwargs`: an object of further chat-template variables, or absent.
    pub fn template_kwargs(&self) -> Result<Option<serde_json::Map<String, Value>>, ApiError> {
        match self.get("chat_template_kwargs") {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(o)) => Ok(Some(o.clone())),
            Some(_) => Err(ApiError::invalid("chat_template_kwargs", "`chat_template_kwargs` must be an object")),
        }
    }

    pub fn get(&self, k: &str) -> Option<&'a Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }

    pub fn number(&self, k: &str) -> Result<Option<f64>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| wrong_type(k, "a number", v)),
        }
    }

    /// A number in [lo, hi] (or (lo, hi] when `open_lo`).
    pub fn float_in(&self, k: &str, lo: f64, hi: f64, open_lo: bool) -> Result<Option<f32>, ApiError> {
        let Some(x) = self.number(k)? else { return Ok(None) };
        let ok = if open_lo { x > lo } else { x >= lo } && x <= hi;
        if !ok {
            let range = if open_lo { format!("({lo}, {hi}]") } else { format!("[{lo}, {hi}]") };
            return Err(ApiError::invalid(k, format!("`{k}` must be in {range}, got {x}")));
        }
        Ok(Some(x as f32))
    }

    pub fn int(&self, k: &str) -> Result<Option<i64>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => as_int(v).map(Some).ok_or_else(|| not_an_int(k, v)),
        }
    }

    /// An integer in [lo, hi].
    pub fn int_in(&self, k: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
        let Some(x) = self.int(k)? else { return Ok(None) };
        if x < lo || x > hi {
            let msg = if hi == i64::MAX {
                format!("`{k}` must be at least {lo}, got {x}")
            } else {
                format!("`{k}` must be in [{lo}, {hi}], got {x}")
            };
            return Err(ApiError::invalid(k, msg));
        }
        Ok(Some(x))
    }

    pub fn bool(&self, k: &str) -> Result<Option<bool>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(wrong_type(k, "a boolean", v)),
        }
    }

    pub fn string(&self, k: &str) -> Result<Option<&'a str>, ApiError> {
        match self.get(k) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(wrong_type(k, "a string", v)),
        }
    }
}
