//! Request bodies: the `Content-Type`, the size and the time they may take to arrive, and a
//! JSON parse whose memory is bounded by the body's size.
//!
//! A `serde_json::Value` costs 80 bytes or more per JSON value (`[1,1,1,...]` is 2 bytes of
//! text per value), so a 4 MiB body of tiny values would cost hundreds of megabytes. The parse
//! here counts values as it builds them and stops at [`MAX_JSON_VALUES`]; the one field that
//! legitimately holds huge arrays, a completion's token-id prompts (`prompt`, and
//! `/detokenize`'s `tokens`), is read straight into `u32`s, with its counts (prompts, ids per
//! prompt) checked while it is read, so nothing past a limit is ever built.

use super::error::ApiError;
use super::params::Prompt;
use axum::body::Body;
use axum::http::{header, HeaderMap};
use futures_util::StreamExt;
use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};
use std::cell::{Cell, RefCell};
use std::fmt;
use std::time::Duration;

/// Most JSON values (numbers, strings, arrays, objects, ...) in a request body outside a
/// token-id field: ~20 MB of parsed values at most. A long conversation with tools is tens of
/// thousands.
pub const MAX_JSON_VALUES: usize = 200_000;
/// After a body turned out too large, read at most this much more of it so the client sees the
/// 413 instead of a reset connection.
const DRAIN_CAP: usize = 64 << 20;

/// 415 unless the body is declared JSON (`application/json`, any parameters). Browsers send a
/// cross-site POST without a preflight only as `text/plain`, form or multipart data, so this
/// also keeps other web pages from reaching a server on localhost.
pub fn check_json_content_type(headers: &HeaderMap) -> Result<(), ApiError> {
    let ct = headers.get(header::CONTENT_TYPE).map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
    let mime = ct.as_deref().map(|c| c.split(';').next().unwrap_or("").trim().to_ascii_lowercase());
    match mime.as_deref() {
        Some("application/json") => Ok(()),
        _ => Err(ApiError::unsupported_media_type(ct.as_deref())),
    }
}

/// The body's bytes: 413 over `limit` bytes, 408 if it has not all arrived within `timeout`
/// (None: no limit) of the request's head, 415 if it is not declared JSON. The body is read
/// even when it will be refused, so that the connection can carry the next request.
pub async fn read(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    timeout: Option<Duration>,
) -> Result<Vec<u8>, ApiError> {
    let read = read_limited(headers, body, limit);
    let data = match timeout {
        None => read.await,
        Some(t) => tokio::time::timeout(t, read).await.unwrap_or_else(|_| Err(ApiError::body_timed_out(t))),
    }?;
    check_json_content_type(headers)?;
    Ok(data)
}

async fn read_limited(headers: &HeaderMap, body: Body, limit: usize) -> Result<Vec<u8>, ApiError> {
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok());
    let mut chunks = body.into_data_stream();
    let mut data = Vec::new();
    let mut over = declared.is_some_and(|n| n > limit as u64);
    if !over {
        if let Some(n) = declared {
            data.reserve_exact(n as usize);
        }
        while let Some(chunk) = chunks.next().await {
            let chunk = chunk.map_err(|e| ApiError::bad_request(format!("could not read the request body: {e}")))?;
            if data.len() + chunk.len() > limit {
                over = true;
                break;
            }
            data.extend_from_slice(&chunk);
        }
    }
    if over {
        if declared.is_none_or(|n| n <= (limit + DRAIN_CAP) as u64) {
            let mut drained = 0;
            while let Some(Ok(c)) = chunks.next().await {
                drained += c.len();
                if drained > DRAIN_CAP {
                    break;
                }
            }
        }
        return Err(ApiError::too_large(limit));
    }
    Ok(data)
}

/// How a token-id field is read (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct IdField {
    /// The top-level key (`prompt`, `tokens`).
    pub key: &'static str,
    pub vocab: usize,
    /// Most prompts (lists of ids, or strings) in it.
    pub max_prompts: usize,
    /// Most ids in one list; more is refused as `too_long`.
    pub max_ids: usize,
    /// The error for a list longer than `max_ids` (given `max_ids`).
    pub too_long: fn(usize) -> ApiError,
    /// An empty array is one empty id list (else a 400).
    pub empty_ok: bool,
}

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

struct Ctx {
    budget: Cell<usize>,
    /// The API error that stopped the parse (a limit), if one did.
    error: RefCell<Option<ApiError>>,
    ids: Option<IdField>,
}

impl Ctx {
    fn fail<E: de::Error>(&self, e: ApiError) -> E {
        let msg = e.message.clone();
        *self.error.borrow_mut() = Some(e);
        E::custom(msg)
    }

    fn count<E: de::Error>(&self) -> Result<(), E> {
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

/// The prompts of a token-id field: a string, an array of strings, an array of ids, or an
/// array of id arrays (null: absent).
struct PromptsSeed<'a>(&'a Ctx, IdField);

impl PromptsSeed<'_> {
    fn bad<E: de::Error>(&self) -> E {
        let key = self.1.key;
        self.0.fail(ApiError::invalid(
            key,
            format!(
                "`{key}` must be a string, an array of strings, an array of token ids, or an array of token-id arrays"
            ),
        ))
    }
}

impl<'de> DeserializeSeed<'de> for PromptsSeed<'_> {
    type Value = Option<Vec<Prompt>>;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for PromptsSeed<'_> {
    type Value = Option<Vec<Prompt>>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("prompts")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
        Ok(Some(vec![Prompt::Text(s.to_string())]))
    }
    fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
        Ok(Some(vec![Prompt::Text(s)]))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Err(self.bad())
    }
    fn visit_i64<E: de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Err(self.bad())
    }
    fn visit_u64<E: de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Err(self.bad())
    }
    fn visit_f64<E: de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Err(self.bad())
    }
    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Self::Value, A::Error> {
        Err(self.bad())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Self::Value, A::Error> {
        let (ctx, f) = (self.0, self.1);
        let key = f.key;
        let mut out: Vec<Prompt> = Vec::new();
        let mut flat: Vec<u32> = Vec::new();
        // What the first element was: strings, ids (one flat list) or id lists.
        let mut kind: Option<u8> = None;
        while let Some(item) =
            s.next_element_seed(ItemSeed { ctx, f, flat: &mut flat, flat_ok: kind.is_none_or(|k| k == b'n') })?
        {
            let k = match item {
                Item::Text(_) => b's',
                Item::Id => b'n',
                Item::Ids(_) => b'a',
            };
            if kind.is_some_and(|was| was != k) {
                return Err(self.bad());
            }
            kind = Some(k);
            match item {
                Item::Text(t) => out.push(Prompt::Text(t)),
                Item::Ids(ids) => {
                    if ids.is_empty() {
                        return Err(ctx.fail(ApiError::invalid(key, "token-id prompts must not be empty")));
                    }
                    out.push(Prompt::Ids(ids))
                }
                Item::Id => {}
            }
            if out.len() > f.max_prompts {
                return Err(ctx.fail(ApiError::invalid(key, format!("at most {} prompts per request", f.max_prompts))));
            }
        }
        match kind {
            None if f.empty_ok => Ok(Some(vec![Prompt::Ids(Vec::new())])),
            None => Err(ctx.fail(ApiError::invalid(key, format!("`{key}` must not be empty")))),
            Some(b'n') => Ok(Some(vec![Prompt::Ids(flat)])),
            _ => Ok(Some(out)),
        }
    }
}

enum Item {
    Text(String),
    /// An id, pushed onto the flat list.
    Id,
    Ids(Vec<u32>),
}

/// One element of a prompts array: ids are pushed onto `flat` (allowed while `flat_ok`: the
/// array holds ids so far).
struct ItemSeed<'a, 'b> {
    ctx: &'a Ctx,
    f: IdField,
    flat: &'b mut Vec<u32>,
    flat_ok: bool,
}

/// A token id from a JSON number (2.0 counts; 2.5, negative or past the vocabulary do not).
fn token_id<E: de::Error>(ctx: &Ctx, f: &IdField, x: f64) -> Result<u32, E> {
    let key = f.key;
    if x.fract() != 0.0 || !x.is_finite() {
        return Err(ctx.fail(ApiError::invalid(key, format!("`{key}` must hold integer token ids, got {x}"))));
    }
    if x < 0.0 || x >= f.vocab as f64 {
        return Err(ctx.fail(ApiError::invalid(
            key,
            format!("token id {x} in `{key}` is outside the vocabulary (size {})", f.vocab),
        )));
    }
    Ok(x as u32)
}

impl ItemSeed<'_, '_> {
    fn push_id<E: de::Error>(self, x: f64) -> Result<Item, E> {
        if !self.flat_ok {
            return Err(PromptsSeed(self.ctx, self.f).bad());
        }
        let id = token_id(self.ctx, &self.f, x)?;
        if self.flat.len() >= self.f.max_ids {
            return Err(self.ctx.fail((self.f.too_long)(self.f.max_ids)));
        }
        self.flat.push(id);
        Ok(Item::Id)
    }
}

impl<'de> DeserializeSeed<'de> for ItemSeed<'_, '_> {
    type Value = Item;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Item, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ItemSeed<'_, '_> {
    type Value = Item;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a prompt")
    }
    fn visit_u64<E: de::Error>(self, x: u64) -> Result<Item, E> {
        self.push_id(x as f64)
    }
    fn visit_i64<E: de::Error>(self, x: i64) -> Result<Item, E> {
        self.push_id(x as f64)
    }
    fn visit_f64<E: de::Error>(self, x: f64) -> Result<Item, E> {
        self.push_id(x)
    }
    fn visit_str<E: de::Error>(self, s: &str) -> Result<Item, E> {
        Ok(Item::Text(s.to_string()))
    }
    fn visit_string<E: de::Error>(self, s: String) -> Result<Item, E> {
        Ok(Item::Text(s))
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Item, E> {
        Err(PromptsSeed(self.ctx, self.f).bad())
    }
    fn visit_unit<E: de::Error>(self) -> Result<Item, E> {
        Err(PromptsSeed(self.ctx, self.f).bad())
    }
    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Item, A::Error> {
        Err(PromptsSeed(self.ctx, self.f).bad())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut s: A) -> Result<Item, A::Error> {
        let mut ids = Vec::new();
        while let Some(x) = s.next_element_seed(IdSeed(self.ctx, self.f))? {
            if ids.len() >= self.f.max_ids {
                return Err(self.ctx.fail((self.f.too_long)(self.f.max_ids)));
            }
            ids.push(x);
        }
        Ok(Item::Ids(ids))
    }
}

/// One id of an id list.
struct IdSeed<'a>(&'a Ctx, IdField);

impl<'de> DeserializeSeed<'de> for IdSeed<'_> {
    type Value = u32;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<u32, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for IdSeed<'_> {
    type Value = u32;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a token id")
    }
    fn visit_u64<E: de::Error>(self, x: u64) -> Result<u32, E> {
        token_id(self.0, &self.1, x as f64)
    }
    fn visit_i64<E: de::Error>(self, x: i64) -> Result<u32, E> {
        token_id(self.0, &self.1, x as f64)
    }
    fn visit_f64<E: de::Error>(self, x: f64) -> Result<u32, E> {
        token_id(self.0, &self.1, x)
    }
    fn visit_str<E: de::Error>(self, _: &str) -> Result<u32, E> {
        Err(PromptsSeed(self.0, self.1).bad())
    }
    fn visit_bool<E: de::Error>(self, _: bool) -> Result<u32, E> {
        Err(PromptsSeed(self.0, self.1).bad())
    }
    fn visit_unit<E: de::Error>(self) -> Result<u32, E> {
        Err(PromptsSeed(self.0, self.1).bad())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<u32, A::Error> {
        Err(PromptsSeed(self.0, self.1).bad())
    }
    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<u32, A::Error> {
        Err(PromptsSeed(self.0, self.1).bad())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(max_prompts: usize, max_ids: usize) -> IdField {
        IdField {
            key: "prompt",
            vocab: 100,
            max_prompts,
            max_ids,
            too_long: |n| ApiError::invalid("prompt", format!("more than {n} ids")),
            empty_ok: false,
        }
    }

    fn prompts(body: &str) -> Result<Option<Vec<Prompt>>, ApiError> {
        parse(body.as_bytes(), Some(field(3, 4))).map(|p| p.prompts)
    }

    #[test]
    fn prompts_of_every_shape() {
        assert_eq!(prompts(r#"{"prompt": "hi"}"#).unwrap(), Some(vec![Prompt::Text("hi".into())]));
        assert_eq!(prompts(r#"{"prompt": ["a", "b"]}"#).unwrap().unwrap().len(), 2);
        assert_eq!(prompts(r#"{"prompt": [1, 2.0, 3]}"#).unwrap(), Some(vec![Prompt::Ids(vec![1, 2, 3])]));
        assert_eq!(
            prompts(r#"{"prompt": [[1], [2, 3]]}"#).unwrap(),
            Some(vec![Prompt::Ids(vec![1]), Prompt::Ids(vec![2, 3])])
        );
        assert_eq!(prompts(r#"{"prompt": null}"#).unwrap(), None);
        assert_eq!(prompts(r#"{"x": 1}"#).unwrap(), None);
        // The last duplicate wins.
        assert_eq!(prompts(r#"{"prompt": [1], "prompt": "t"}"#).unwrap(), Some(vec![Prompt::Text("t".into())]));
        assert_eq!(prompts(r#"{"prompt": [1], "prompt": null}"#).unwrap(), None);
        let p = parse(br#"{"prompt": [1], "n": 2}"#, Some(field(3, 4))).unwrap();
        assert!(!p.obj.contains_key("prompt") && p.obj["n"] == 2);
    }

    #[test]
    fn limits_stop_the_parse() {
        for (body, what) in [
            (r#"{"prompt": [1, 2, 3, 4, 5]}"#, "more than 4 ids"),
            (r#"{"prompt": [[1], [1, 2, 3, 4, 5]]}"#, "more than 4 ids"),
            (r#"{"prompt": [[1], [1], [1], [1]]}"#, "at most 3 prompts"),
            (r#"{"prompt": ["a", "b", "c", "d"]}"#, "at most 3 prompts"),
            (r#"{"prompt": [100]}"#, "outside the vocabulary"),
            (r#"{"prompt": [-1]}"#, "outside the vocabulary"),
            (r#"{"prompt": [1.5]}"#, "integer token ids"),
            (r#"{"prompt": [1, "a"]}"#, "must be a string"),
            (r#"{"prompt": ["a", 1]}"#, "must be a string"),
            (r#"{"prompt": [[1], 2]}"#, "must be a string"),
            (r#"{"prompt": [[]]}"#, "must not be empty"),
            (r#"{"prompt": []}"#, "must not be empty"),
            (r#"{"prompt": 5}"#, "must be a string"),
            (r#"{"prompt": [{"a": 1}]}"#, "must be a string"),
        ] {
            let e = prompts(body).unwrap_err();
            assert!(e.message.contains(what), "{body}: {}", e.message);
            assert_eq!(e.param.as_deref(), Some("prompt"), "{body}");
        }
    }

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

    #[test]
    fn content_type_must_be_json() {
        let mut h = HeaderMap::new();
        assert_eq!(check_json_content_type(&h).unwrap_err().status.as_u16(), 415);
        for (ct, ok) in [
            ("application/json", true),
            ("Application/JSON; charset=utf-8", true),
            ("text/plain", false),
            ("application/x-www-form-urlencoded", false),
            ("multipart/form-data; boundary=x", false),
            ("application/jsonx", false),
        ] {
            h.insert(header::CONTENT_TYPE, ct.parse().unwrap());
            assert_eq!(check_json_content_type(&h).is_ok(), ok, "{ct}");
        }
    }
}
