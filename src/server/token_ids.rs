//! A token-id field of a request body (a completion's `prompt`, `/detokenize`'s `tokens`),
//! read straight into `u32`s while the body is parsed (see `json`): a string, an array of
//! strings, an array of ids, or an array of id arrays, with the number of prompts, the ids per
//! prompt and the vocabulary checked as they are read.

use super::error::ApiError;
use super::json::Ctx;
use super::params::Prompt;
use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use std::fmt;

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

/// The prompts of a token-id field: a string, an array of strings, an array of ids, or an
/// array of id arrays (null: absent).
pub(super) struct PromptsSeed<'a>(pub(super) &'a Ctx, pub(super) IdField);

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
pub(crate) mod tests {
    use super::*;
    use crate::server::json::parse;

    pub(crate) fn field(max_prompts: usize, max_ids: usize) -> IdField {
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
}
