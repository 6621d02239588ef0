//! A request body's JSON, parsed with its memory bounded by its size.
//!
//! A `serde_json::Value` costs 80 bytes or more per JSON value (`[1,1,1,...]` is 2 bytes of
//! text per value), so a 4 MiB body of tiny values would cost hundreds of megabytes. The parse
//! here counts values as it builds them and stops at [`MAX_JSON_VALUES`]; the one field that
//! legitimately holds huge arrays, a completion's token-id prompts (`prompt`, and
//! `/detokenize`'s `tokens`), is read straight into `u32`s by `token_ids`, with its counts
//! checked while it is read, so nothing past a limit is ever built.

use super::error::ApiError;
use super::params::Prompt;
use super::token_ids::{IdField, PromptsSeed};
use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};
use std::cell::{Cell, RefCell};
use std::fmt;

/// Most JSON values (numbers, strings, arrays, objects, ...) in a request body outside a
/// token-id field: ~20 MB of parsed values at most. A long conversation with tools is tens of
/// thousands.
pub const MAX_JSON_VALUES: usize = 200_000;

/// A parsed body: its top-level object, and the token-id field read apart from it (None when
/// absent or null; then it is not in `obj` either).
#[derive(Debug, Default)]
pub struct Parsed {
    pub obj: Map<String, Value>,
    pub prompts: Option<Vec<Prompt>>,
    /// The body's size in bytes.
    pub bytes: usize,
    /// What the body left of [`MAX_JSON_VALUES`], for JSON held in its strings (see
    /// [`parse_embedded`]).
    pub values_left: usize,
}

thread_local! {
    /// The current request's budget for [`parse_embedded`] (see [`with_budget`]); None
    /// outside a request.
    static EMBEDDED: Cell<Option<usize>> = const { Cell::new(None) };
}

/// Runs `f` (a request's parsing, on a worker thread) with `left` JSON values allowed to
/// [`parse_embedded`]; returns what `f` returned and what is left.
pub fn with_budget<T>(left: usize, f: impl FnOnce() -> T) -> (T, usize) {
    let before = EMBEDDED.with(|b| b.replace(Some(left)));
    let r = f();
    let left = EMBEDDED.with(|b| b.replace(before)).unwrap_or(0);
    (r, left)
}

/// JSON text held in one of a request's strings (a schema, tool-call arguments), parsed with
/// the same accounting as the body: within [`with_budget`], its values count against what the
/// body left of [`MAX_JSON_VALUES`], so strings cannot amplify where the body could not
/// (outside, each text gets [`MAX_JSON_VALUES`] of its own).
pub fn parse_embedded(text: &str) -> Result<Value, String> {
    let left = EMBEDDED.with(Cell::get);
    let ctx = Ctx { budget: Cell::new(left.unwrap_or(MAX_JSON_VALUES)), error: RefCell::new(None), ids: None };
    let mut de = serde_json::Deserializer::from_str(text);
    let r = ValueSeed(&ctx).deserialize(&mut de).and_then(|v| de.end().map(|()| v));
    if left.is_some() {
        EMBEDDED.with(|b| b.set(Some(ctx.budget.get())));
    }
    r.map_err(|e| match ctx.error.take() {
        Some(_) => format!("it holds more JSON values than a request may ({MAX_JSON_VALUES} in all)"),
        None => format!("it is not valid JSON: {e}"),
    })
}

/// Parses `data` as a JSON object, with at most [`MAX_JSON_VALUES`] values outside `ids`'s
/// field. 400 for invalid UTF-8, invalid JSON, anything but an object, or a limit passed.
pub fn parse(data: &[u8], ids: Option<IdField>) -> Result<Parsed, ApiError> {
    let text = std::str::from_utf8(data)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid UTF-8: {e}")))?;
    if text.trim().is_empty() {
        return Err(ApiError::bad_request("the request body is empty; send a JSON object"));
    }
    let ctx = Ctx { budget: Cell::new(MAX_JSON_VALUES), error: RefCell::new(None), ids };
    let mut de = serde_json::Deserializer::from_str(text);
    let r = TopSeed(&ctx).deserialize(&mut de).and_then(|p| de.end().map(|()| p));
    match r {
        Ok(Some(p)) => Ok(Parsed { bytes: data.len(), values_left: ctx.budget.get(), ..p }),
        Ok(None) => Err(ApiError::bad_request("the request body must be a JSON object")),
        Err(e) => Err(ctx
            .error
            .take()
            .unwrap_or_else(|| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))),
    }
}

pub(super) struct Ctx {
    pub(super) budget: Cell<usize>,
    /// The API error that stopped the parse (a limit), if one did.
    pub(super) error: RefCell<Option<ApiError>>,
    pub(super) ids: Option<IdField>,
}

impl Ctx {
    pub(super) fn fail<E: de::Error>(&self, e: ApiError) -> E {
        let msg = e.message.clone();
        *self.error.borrow_mut() = Some(e);
        E::custom(msg)
    }

    pub(super) fn count<E: de::Error>(&self) -> Result<(), E> {
        let left = self.budget.get();
        if left == 0 {
            return Err(self.fail(ApiError::bad_request(format!(
                "the request body holds more than {MAX_JSON_VALUES} JSON values"
            ))));
        }
        self.budget.set(left - 1);
        Ok(())
    }
}

/// The top level: an object (Some) or any other value (None, for a 400).
struct TopSeed<'a>(&'a Ctx);

impl<'de> DeserializeSeed<'de> for TopSeed<'_> {
    type Value = Option<Parsed>;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for TopSeed<'_> {
    type Value = Option<Parsed>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Self::Value, A::Error> {
        let mut p = Parsed::default();
        while let Some(k) = m.next_key::<String>()? {
            self.0.count()?;
            match self.0.ids {
                // A duplicate key: the last one counts, as for every other field.
                Some(f) if k == f.key => p.prompts = m.next_value_seed(PromptsSeed(self.0, f))?,
                _ => {
                    let v = m.next_value_seed(ValueSeed(self.0))?;
                    p.obj.insert(k, v);
                }
            }
        }
        Ok(Some(p))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Self::Value, A::Error> {
        while s.next_element_seed(ValueSeed(self.0))?.is_some() {}
        Ok(None)
    }
    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
}

/// A `serde_json::Value`, each value counted against the budget.
struct ValueSeed<'a>(&'a Ctx);

impl<'de> DeserializeSeed<'de> for ValueSeed<'_> {
    type Value = Value;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ValueSeed<'_> {
    type Value = Value;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E: de::Error>(self, b: bool) -> Result<Value, E> {
        self.0.count()?;
        Ok(Value::Bool(b))
    }
    fn visit_i64<E: de::Error>(self, x: i64) -> Result<Value, E> {
        self.0.count()?;
        Ok(Value::Number(x.into()))
    }
    fn visit_u64<E: de::Error>(self, x: u64) -> Result<Value, E> {
        self.0.count()?;
        Ok(Value::Number(x.into()))
    }
    fn visit_f64<E: de::Error>(self, x: f64) -> Result<Value, E> {
        self.0.count()?;
        Ok(Number::from_f64(x).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E: de::Error>(self, s: &str) -> Result<Value, E> {
        self.0.count()?;
        Ok(Value::String(s.to_string()))
    }
    fn visit_string<E: de::Error>(self, s: String) -> Result<Value, E> {
        self.0.count()?;
        Ok(Value::String(s))
    }
    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        self.0.count()?;
        Ok(Value::Null)
    }
    fn visit_none<E: de::Error>(self) -> Result<Value, E> {
        self.visit_unit()
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Value, A::Error> {
        self.0.count()?;
        let mut v = Vec::new();
        while let Some(x) = s.next_element_seed(ValueSeed(self.0))? {
            v.push(x);
        }
        Ok(Value::Array(v))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut m: A) -> Result<Value, A::Error> {
        self.0.count()?;
        let mut o = Map::new();
        while let Some(k) = m.next_key::<String>()? {
            self.0.count()?;
            let v = m.next_value_seed(ValueSeed(self.0))?;
            o.insert(k, v);
        }
        Ok(Value::Object(o))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::token_ids::tests::field;

    #[test]
    fn values_are_counted() {
        let n = MAX_JSON_VALUES;
        let ok = format!("{{\"a\": [{}]}}", vec!["1"; n - 3].join(","));
        assert!(parse(ok.as_bytes(), None).is_ok());
        let over = format!("{{\"a\": [{}]}}", vec!["1"; n].join(","));
        let e = parse(over.as_bytes(), None).unwrap_err();
        assert!(e.message.contains(&n.to_string()), "{}", e.message);
        // Token ids are not counted.
        let f = IdField { max_ids: n * 2, ..field(3, 4) };
        let ids = format!("{{\"prompt\": [{}]}}", vec!["1"; n + 10].join(","));
        assert_eq!(parse(ids.as_bytes(), Some(f)).unwrap().prompts.unwrap().len(), 1);
        for (body, what) in [
            ("[1]", "must be a JSON object"),
            ("3", "must be a JSON object"),
            ("", "empty"),
            ("{\"a\": 1} x", "not valid JSON"),
            ("{\"a\": NaN}", "not valid JSON"),
        ] {
            let e = parse(body.as_bytes(), None).unwrap_err();
            assert!(e.message.contains(what), "{body}: {}", e.message);
        }
        assert!(parse(b"{\"a\": \"\xff\"}", None).unwrap_err().message.contains("UTF-8"));
        let v = parse(br#"{"a": {"b": [1, -2, 2.5, true, null, "s"]}}"#, None).unwrap();
        assert_eq!(Value::Object(v.obj), serde_json::json!({"a": {"b": [1, -2, 2.5, true, null, "s"]}}));
    }

    #[test]
    fn embedded_json_shares_the_budget() {
        let p = parse(br#"{"a": [1, 2, 3]}"#, None).unwrap();
        assert_eq!(p.values_left, MAX_JSON_VALUES - 5);
        let (v, left) = with_budget(10, || parse_embedded("[1, [2, 3]]"));
        assert_eq!((v.unwrap(), left), (serde_json::json!([1, [2, 3]]), 5));
        let (e, left) = with_budget(3, || parse_embedded("[1, 2, 3, 4]"));
        assert!(e.unwrap_err().contains(&MAX_JSON_VALUES.to_string()));
        assert!(parse_embedded("{").unwrap_err().contains("not valid JSON"));
        assert_eq!(left, 0);
        assert!(with_budget(10, || parse_embedded("[1,")).0.is_err());
        // Outside a request: a budget of its own each time.
        assert!(parse_embedded("[1, 2]").is_ok() && parse_embedded("[1, 2]").is_ok());
    }
}
