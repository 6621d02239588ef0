//! Chat templates: Jinja (minijinja) with the conventions Hugging Face uses when rendering
//! them: `trim_blocks` and `lstrip_blocks` on, Python string/dict methods (`.strip()`,
//! `.startswith()`, `.items()`, ...), `raise_exception(msg)` and `strftime_now(fmt)`.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, Result};
use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Value as Json;

use super::ChatMessage;

const NAME: &str = "chat_template";

/// The most instructions one render may run (minijinja's fuel): a template that loops stops
/// with an error instead of holding a thread for ever. Real templates use a few hundred per
/// message (SmolLM2's: ~60; 10,000 messages with tools stay far below).
pub const TEMPLATE_FUEL: u64 = 20_000_000;
/// The longest text a render may produce, in bytes.
pub const MAX_RENDER_BYTES: usize = 16 << 20;

/// Gemma's turn format, for Gemma GGUF files that carry no chat template (base models), as
/// llama.cpp's built-in `gemma` template writes it: `<start_of_turn>{role}\n{content}<end_of_turn>\n`
/// per message (the assistant's role is `model`; system text opens the first user turn, followed
/// by a blank line), then `<start_of_turn>model\n` for the answer.
pub(super) const GEMMA_TEMPLATE: &str = "{{ bos_token }}\
{%- set ns = namespace(system='') -%}
{%- for m in messages -%}
{%- if m['role'] == 'system' -%}
{%- set ns.system = ns.system + (m['content'] | trim) -%}
{%- else -%}
{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}
{{ '<start_of_turn>' + role + '\\n' }}
{%- if ns.system and role != 'model' -%}
{{ ns.system + '\\n\\n' }}
{%- set ns.system = '' -%}
{%- endif -%}
{{ (m['content'] | trim) + '<end_of_turn>\\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<start_of_turn>model\\n' }}
{%- endif -%}";

/// The built-in template (its name and source) for a GGUF `general.architecture` whose file
/// has none, where the family has one format.
pub(super) fn builtin_template(arch: &str) -> Option<(&'static str, &'static str)> {
    matches!(arch, "gemma" | "gemma2" | "gemma3").then_some(("gemma", GEMMA_TEMPLATE))
}

pub(super) struct ChatTemplate {
    env: Environment<'static>,
    /// Set when the template failed to compile; reported on use so that a model with a broken
    /// template still loads for plain completions.
    compile_error: Option<String>,
    /// Whether the source mentions `tools` (it renders tool definitions itself).
    pub(super) mentions_tools: bool,
    /// The template's source (the reasoning parser's `auto` reads it).
    pub(super) source: String,
}

impl ChatTemplate {
    pub(super) fn new(source: String) -> Self {
        let mut env = Environment::new();
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        let mentions_tools = source.contains("tools");
        let compile_error = env
            .add_template_owned(NAME, source.clone())
            .err()
            .map(|e| format!("cannot compile the chat template: {}", one_line(&e)));
        ChatTemplate { env, compile_error, mentions_tools, source }
    }

    pub(super) fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Json]>,
        add_generation_prompt: bool,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
        extra: Option<&serde_json::Map<String, Json>>,
    ) -> Result<String> {
        if let Some(e) = &self.compile_error {
            return Err(anyhow!("{e}"));
        }
        let tmpl = self.env.get_template(NAME).map_err(|e| anyhow!("{}", one_line(&e)))?;
        // Absent special tokens stay undefined (render as ""), as in Hugging Face, rather than
        // becoming `none`.
        let mut ctx: BTreeMap<&str, Value> = BTreeMap::new();
        ctx.insert("messages", Value::from_serialize(messages));
        ctx.insert("add_generation_prompt", Value::from(add_generation_prompt));
        if let Some(t) = tools {
            ctx.insert("tools", Value::from_serialize(t));
        }
        if let Some(b) = bos_token {
            ctx.insert("bos_token", Value::from(b));
        }
        if let Some(e) = eos_token {
            ctx.insert("eos_token", Value::from(e));
        }
        // A request's `chat_template_kwargs` (e.g. `enable_thinking`), never in place of the
        // variables above.
        for (k, v) in extra.into_iter().flatten() {
            if !ctx.contains_key(k.as_str()) {
                ctx.insert(k.as_str(), Value::from_serialize(v));
            }
        }
        let mut out = Capped { buf: Vec::new(), cap: MAX_RENDER_BYTES };
        match tmpl.render_captured_to(ctx, &mut out) {
            Ok(_) => String::from_utf8(out.buf).map_err(|_| anyhow!("rendering failed: the output is not UTF-8")),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(anyhow!(
                "rendering failed: the chat template ran more than {TEMPLATE_FUEL} instructions (a loop that does not end?)"
            )),
            Err(_) if out.buf.len() >= MAX_RENDER_BYTES => {
                Err(anyhow!("rendering failed: the chat template's output passed {MAX_RENDER_BYTES} bytes"))
            }
            Err(e) => Err(anyhow!("rendering failed: {}", one_line(&e))),
        }
    }
}

/// A writer that fails once `cap` bytes have been written.
struct Capped {
    buf: Vec<u8>,
    cap: usize,
}

impl std::io::Write for Capped {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        if self.buf.len() + b.len() > self.cap {
            self.buf.resize(self.cap, 0);
            return Err(std::io::Error::other("the output is too long"));
        }
        self.buf.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn one_line(e: &Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s.replace('\n', " ")
}

/// Hugging Face's `tojson`: Python's `json.dumps(value, ensure_ascii=False, indent=indent)`,
/// so `", "` and `": "` separators (or `indent` spaces per level) and no HTML escaping, which
/// minijinja's own filter does. Keys keep their order (serde_json with `preserve_order`, as Python dicts do).
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")?.or(indent) {
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) => Some(usize::try_from(v.clone()).map_err(|_| {
            Error::new(ErrorKind::InvalidOperation, format!("tojson: indent must be a non-negative integer, got {v}"))
        })?),
        None => None,
    };
    kwargs.assert_all_used()?;
    let json: Json = serde_json::to_value(value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: cannot serialize: {e}")))?;
    let mut out = String::new();
    python_json(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

fn python_json(v: &Json, indent: Option<usize>, depth: usize, out: &mut String) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v {
        Json::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                python_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Json::Object(o) if !o.is_empty() => {
            out.push('{');
            for (i, (k, x)) in o.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&Json::String(k.clone()).to_string());
                out.push_str(": ");
                python_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, format!("template raised an exception: {msg}")))
}

/// Python's `datetime.now().strftime(fmt)` for the common directives, in UTC.
fn strftime_now(fmt: String) -> String {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0);
    format_time(secs, &fmt)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// Proleptic Gregorian (year, month 1-12, day 1-31) of a count of days since 1970-01-01.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    // Shift the epoch to 0000-03-01 so leap days fall at the end of each 400-year era.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of era, 0..146096
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // year of era, 0..399
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of the March-based year
    let mp = (5 * doy + 2) / 153; // March = 0
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn format_time(secs: i64, fmt: &str) -> String {
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday (Monday = 0)
    let is_leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[month as usize - 1] + day + u32::from(is_leap && month > 2);
    let (h, m, s) = (sod / 3600, (sod / 60) % 60, sod % 60);
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('-') => match chars.next() {
                Some('d') => out.push_str(&day.to_string()),
                Some('m') => out.push_str(&month.to_string()),
                Some(o) => {
                    out.push_str("%-");
                    out.push(o);
                }
                None => out.push_str("%-"),
            },
            Some('B') => out.push_str(MONTHS[month as usize - 1]),
            Some('b') => out.push_str(&MONTHS[month as usize - 1][..3]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..3]),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('M') => out.push_str(&format!("{m:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('%') => out.push('%'),
            Some(o) => {
                out.push('%');
                out.push(o);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tojson_is_pythons_json_dumps() {
        let t = ChatTemplate::new(
            "{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}|{{ 'a<b' | tojson }}|{{ [] | tojson }}".into(),
        );
        let tools =
            [serde_json::json!({"type": "function", "function": {"name": "f", "parameters": {}, "d": [1, "é"]}})];
        let out = t.render(&[], Some(&tools), false, None, None, None).unwrap();
        assert_eq!(
            out,
            // Keys in their given order, as Python's dicts keep them.
            "[{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {}, \"d\": [1, \"é\"]}}]|{\n  \
             \"type\": \"function\",\n  \"function\": {\n    \"name\": \"f\",\n    \"parameters\": {},\n    \"d\": [\n      1,\n      \
             \"é\"\n    ]\n  }\n}|\"a<b\"|[]"
        );
        assert!(t.mentions_tools);
        assert!(!ChatTemplate::new("{{ messages }}".into()).mentions_tools);
        // Without tools, `tools` is undefined.
        let t = ChatTemplate::new("{% if tools %}yes{% else %}no{% endif %}".into());
        assert_eq!(t.render(&[], None, false, None, None, None).unwrap(), "no");
    }

    #[test]
    fn template_kwargs_are_variables_but_never_replace_the_standard_ones() {
        let t = ChatTemplate::new(
            "{% if enable_thinking is defined and not enable_thinking %}off{% else %}on{% endif %}|{{ add_generation_prompt }}|{{ messages | length }}".into(),
        );
        let kw = |v: serde_json::Value| v.as_object().unwrap().clone();
        assert_eq!(t.render(&[], None, true, None, None, None).unwrap(), "on|True|0");
        let off = kw(serde_json::json!({"enable_thinking": false}));
        assert_eq!(t.render(&[], None, true, None, None, Some(&off)).unwrap(), "off|True|0");
        let hostile = kw(serde_json::json!({"add_generation_prompt": false, "messages": [1, 2, 3]}));
        assert_eq!(t.render(&[], None, true, None, None, Some(&hostile)).unwrap(), "on|True|0");
    }

    #[test]
    fn renders_are_bounded() {
        // A loop that never ends in practice: stopped by fuel.
        let t = ChatTemplate::new(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}".into(),
        );
        let t0 = std::time::Instant::now();
        let e = t.render(&[], None, false, None, None, None).unwrap_err().to_string();
        assert!(e.contains("instructions"), "{e}");
        eprintln!("fuel ran out after {:?}", t0.elapsed());
        // Output past the cap.
        let t = ChatTemplate::new("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}".into());
        let e = t.render(&[], None, false, None, None, None).unwrap_err().to_string();
        assert!(e.contains(&MAX_RENDER_BYTES.to_string()), "{e}");
        // A real template on many messages stays within both.
        let t = ChatTemplate::new(
            "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}".into(),
        );
        let msgs: Vec<ChatMessage> = (0..20_000).map(|i| ChatMessage::new("user", format!("m{i}"))).collect();
        let out = t.render(&msgs, None, true, None, None, None).unwrap();
        assert!(out.ends_with("<|im_start|>assistant\n") && out.contains("m19999"));
    }

    #[test]
    fn dates() {
        assert_eq!(format_time(0, "%Y-%m-%d %H:%M:%S %a %j"), "1970-01-01 00:00:00 Thu 001");
        // 2024-02-29 12:34:56 UTC, a Thursday, day 60.
        assert_eq!(format_time(1_709_210_096, "%d %b %Y %A %j %H:%M:%S"), "29 Feb 2024 Thursday 060 12:34:56");
        assert_eq!(format_time(951_782_400, "%-d %B %y"), "29 February 00");
        assert_eq!(format_time(-86_400, "%Y-%m-%d"), "1969-12-31");
    }
}
