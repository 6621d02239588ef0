//! Bounds a constraint must keep before it is compiled: its size, its depth, and (a grammar) its
//! number of alternatives; and how long compiling it may take.
//!
//! The grammar library compiles a JSON schema's `$ref`s and a Lark grammar's rule references
//! recursively, one stack frame chain per level (up to ~6 KiB a level, measured with
//! llguidance 1.9): a chain of 1,000 references overflows a 2 MiB thread stack, and a stack
//! overflow aborts the whole process. So a constraint is measured first, without recursion:
//! [`MAX_DEPTH`] levels of nesting (schema objects inside each other, references followed) and
//! [`MAX_BYTES`] of text at most, and compiled on a thread whose stack holds many times that
//! depth ([`COMPILE_STACK_BYTES`]).

use super::ConstraintSpec;
use serde_json::Value;
use std::collections::{HashMap, HashSet};

/// Most levels of nesting a constraint may have: JSON schema objects and arrays inside each
/// other with `$ref`s followed, or Lark rules referring to each other (plus the schemas they
/// embed with `%json`). Real schemas and grammars stay far below (tens of levels).
pub const MAX_DEPTH: usize = 512;
/// Largest constraint, in bytes of its text (a schema's JSON, a grammar, a regex, the choices).
pub const MAX_BYTES: usize = 1 << 20;
/// Most alternatives a grammar may have, in all its rules: the parser follows at most 2,000
/// items at one position (llguidance's `max_items_in_row`), one of them the grammar's start,
/// and a grammar past it fails while generating, not when compiled.
pub const MAX_ALTERNATIVES: usize = 1999;
/// The longest a constraint may take to compile (on a thread of its own; see `Grammars`).
pub const COMPILE_TIME_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);
/// The stack of the threads that compile constraints: ~16x what [`MAX_DEPTH`] levels take.
pub const COMPILE_STACK_BYTES: usize = 64 << 20;

/// Ok, or why the constraint is too large or too deep (for a 400).
pub fn check(spec: &ConstraintSpec) -> Result<(), String> {
    let bytes = match spec {
        ConstraintSpec::JsonObject => 0,
        ConstraintSpec::JsonSchema { schema, .. } => json_size(schema),
        ConstraintSpec::Regex(r) => r.len(),
        ConstraintSpec::Choice(list) => list.iter().map(|c| c.len() + 1).sum(),
        ConstraintSpec::Lark(g) => g.len(),
    };
    if bytes > MAX_BYTES {
        return Err(format!("the constraint is {bytes} bytes long; at most {MAX_BYTES} bytes are allowed"));
    }
    let depth = match spec {
        ConstraintSpec::JsonSchema { schema, .. } => schema_depth(schema),
        ConstraintSpec::Lark(g) => lark_depth(g),
        _ => 0,
    };
    if let ConstraintSpec::Lark(g) = spec {
        let n = lark_alternatives(g);
        if n > MAX_ALTERNATIVES {
            return Err(format!(
                "the grammar has {n} alternatives in all; at most {MAX_ALTERNATIVES} are allowed (the parser's \
                 limit on the branches it follows at one position)"
            ));
        }
    }
    if depth > MAX_DEPTH {
        return Err(format!(
            "the constraint nests {depth} levels deep (schemas inside schemas, references followed, or grammar \
             rules referring to rules); at most {MAX_DEPTH} levels are allowed"
        ));
    }
    Ok(())
}

/// The length of `v` written as compact JSON (strings counted without their escapes),
/// without writing it.
fn json_size(v: &Value) -> usize {
    let mut n = 0;
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        n += match v {
            Value::Null | Value::Bool(true) => 4,
            Value::Bool(false) => 5,
            Value::Number(x) => x.to_string().len(),
            Value::String(s) => s.len() + 2,
            Value::Array(a) => {
                stack.extend(a);
                2 + a.len().saturating_sub(1)
            }
            Value::Object(o) => {
                stack.extend(o.values());
                // `"key":` per entry, commas between entries.
                2 + o.keys().map(|k| k.len() + 3).sum::<usize>() + o.len().saturating_sub(1)
            }
        };
    }
    n
}

/// What a `$ref` points at inside `root`: `#` or a JSON pointer after `#` (None: another
/// document, an anchor, or nothing there).
fn resolve<'a>(root: &'a Value, r: &str) -> Option<&'a Value> {
    let frag = r.strip_prefix('#')?;
    if frag.is_empty() {
        return Some(root);
    }
    if !frag.starts_with('/') {
        return None;
    }
    let mut at = root;
    for part in frag[1..].split('/') {
        let key = percent_decode(part).replace("~1", "/").replace("~0", "~");
        at = match at {
            Value::Object(o) => o.get(&key)?,
            Value::Array(a) => a.get(key.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some(at)
}

fn percent_decode(s: &str) -> String {
    if !s.contains('%') {
        return s.to_string();
    }
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The longest chain of nested schema values in `root`, following local `$ref`s (a
/// reference back into the chain being followed counts nothing: the library compiles each
/// target once). Iterative, memoized by node: linear in the schema's size.
pub fn schema_depth(root: &Value) -> usize {
    let children = |v: &Value| -> Vec<*const Value> {
        let mut out: Vec<*const Value> = Vec::new();
        match v {
            Value::Array(a) => out.extend(a.iter().filter(|x| x.is_array() || x.is_object()).map(|x| x as *const _)),
            Value::Object(o) => {
                out.extend(o.values().filter(|x| x.is_array() || x.is_object()).map(|x| x as *const _));
                for k in ["$ref", "$dynamicRef", "$recursiveRef"] {
                    if let Some(t) = o.get(k).and_then(Value::as_str).and_then(|r| resolve(root, r)) {
                        out.push(t as *const _);
                    }
                }
            }
            _ => {}
        }
        out
    };
    graph_depth(root as *const Value, |&p| {
        // SAFETY: every pointer comes from a reference into `root`, which outlives this call.
        children(unsafe { &*p })
    })
}

/// The longest path (in nodes) from `start` in the graph `next` describes, where an edge back
/// to a node on the current path counts nothing. Memoized; no recursion.
fn graph_depth<N: Copy + Eq + std::hash::Hash>(start: N, mut next: impl FnMut(&N) -> Vec<N>) -> usize {
    let mut done: HashMap<N, usize> = HashMap::new();
    let mut on_path: HashSet<N> = HashSet::new();
    // (node, its children, next child to visit, deepest child so far)
    let mut stack: Vec<(N, Vec<N>, usize, usize)> = vec![(start, next(&start), 0, 0)];
    on_path.insert(start);
    while let Some(top) = stack.last_mut() {
        if top.2 < top.1.len() {
            let c = top.1[top.2];
            top.2 += 1;
            if let Some(&d) = done.get(&c) {
                top.3 = top.3.max(d);
            } else if !on_path.contains(&c) {
                on_path.insert(c);
                let kids = next(&c);
                stack.push((c, kids, 0, 0));
            }
            continue;
        }
        let (n, _, _, deepest) = stack.pop().expect("non-empty");
        on_path.remove(&n);
        done.insert(n, deepest + 1);
        if let Some(parent) = stack.last_mut() {
            parent.3 = parent.3.max(deepest + 1);
        }
    }
    done.get(&start).copied().unwrap_or(1)
}

/// The depth of a Lark grammar (llguidance's dialect): the longest chain of definitions
/// referring to definitions, plus the deepest JSON schema embedded with `%json`.
pub fn lark_depth(src: &str) -> usize {
    let (defs, json_depth) = lark_definitions(src);
    let names: HashMap<&str, usize> = defs.iter().enumerate().map(|(i, (n, _))| (n.as_str(), i)).collect();
    let edges: Vec<Vec<usize>> =
        defs.iter().map(|(_, refs)| refs.iter().filter_map(|r| names.get(r.as_str()).copied()).collect()).collect();
    let mut deepest = 0;
    let mut seen = vec![false; defs.len()];
    // Every definition counts (the library may compile those `start` does not reach).
    for i in 0..defs.len() {
        if !seen[i] {
            let d = graph_depth(i, |&n| {
                seen[n] = true;
                edges[n].clone()
            });
            deepest = deepest.max(d);
        }
    }
    deepest + json_depth
}

/// The definitions of a Lark grammar, each with the names its body mentions, and the depth of
/// the deepest `%json` schema in it. A light lexer: strings, regexes, comments and embedded
/// JSON are skipped; `name:` (with an optional `.priority`) starts a definition.
fn lark_definitions(src: &str) -> (Vec<(String, Vec<String>)>, usize) {
    let (defs, json_depth, _) = lark_scan(src);
    (defs, json_depth)
}

/// The alternatives of a Lark grammar, in all its definitions: one more than its `|`s.
pub fn lark_alternatives(src: &str) -> usize {
    lark_scan(src).2 + 1
}

/// [`lark_definitions`], and the number of `|`s between alternatives.
fn lark_scan(src: &str) -> (Vec<(String, Vec<String>)>, usize, usize) {
    let b = src.as_bytes();
    let mut defs: Vec<(String, Vec<String>)> = Vec::new();
    let mut json_depth = 0;
    let mut bars = 0;
    let mut i = 0;
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b'-';
    while i < b.len() {
        let c = b[i];
        match c {
            b'#' => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'"' | b'/' => {
                // A string or a regex: up to the unescaped closing quote or slash.
                i += 1;
                while i < b.len() && b[i] != c && b[i] != b'\n' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            b'%' => {
                let start = i + 1;
                i += 1;
                while i < b.len() && ident(b[i]) {
                    i += 1;
                }
                let kw = &src[start..i];
                if matches!(kw, "json" | "regex" | "llguidance") {
                    let rest = &src[i..];
                    let mut it = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
                    if let Some(Ok(v)) = it.next() {
                        if kw == "json" {
                            json_depth = json_depth.max(schema_depth(&v));
                        }
                        i += it.byte_offset();
                    }
                }
            }
            c if c.is_ascii_alphabetic() || c == b'_' || c == b'?' || c == b'!' => {
                let start = i;
                while i < b.len() && (ident(b[i]) || b[i] == b'?' || b[i] == b'!') {
                    i += 1;
                }
                let name = src[start..i].trim_start_matches(['?', '!']).to_string();
                // A definition: `name:` or `name.2:` (not `name::`).
                let mut j = i;
                if b.get(j) == Some(&b'.') && b.get(j + 1).is_some_and(u8::is_ascii_digit) {
                    j += 1;
                    while j < b.len() && (b[j].is_ascii_digit() || b[j] == b'-') {
                        j += 1;
                    }
                }
                while j < b.len() && (b[j] == b' ' || b[j] == b'\t') {
                    j += 1;
                }
                if b.get(j) == Some(&b':') && b.get(j + 1) != Some(&b':') {
                    defs.push((name, Vec::new()));
                    i = j + 1;
                } else if let Some(d) = defs.last_mut() {
                    d.1.push(name);
                }
            }
            b'|' => {
                bars += 1;
                i += 1;
            }
            _ => i += 1,
        }
    }
    (defs, json_depth, bars)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ref_chain(n: usize) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..n {
            defs.insert(format!("a{i}"), json!({"$ref": format!("#/$defs/a{}", i + 1)}));
        }
        defs.insert(format!("a{n}"), json!({"type": "integer"}));
        json!({"$ref": "#/$defs/a0", "$defs": defs})
    }

    #[test]
    fn schema_depth_follows_refs_once() {
        assert_eq!(schema_depth(&json!({"type": "integer"})), 1);
        let nested = json!({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}}}});
        assert_eq!(schema_depth(&nested), 5);
        // root -> a0 -> a1 -> ... -> a{n}: about one level per reference.
        let d = schema_depth(&ref_chain(1000));
        assert!((1000..=1004).contains(&d), "{d}");
        // A recursive schema (a tree) is finite.
        let tree = json!({"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}, "$ref": "#/$defs/node"});
        assert!(schema_depth(&tree) < 10, "{}", schema_depth(&tree));
        // Shared targets are measured once (a diamond does not multiply).
        let mut defs = serde_json::Map::new();
        for i in 0..200 {
            defs.insert(
                format!("d{i}"),
                json!({"anyOf": [{"$ref": format!("#/$defs/d{}", i + 1)}, {"$ref": format!("#/$defs/d{}", i + 1)}]}),
            );
        }
        defs.insert("d200".into(), json!({}));
        let d = schema_depth(&json!({"$defs": defs, "$ref": "#/$defs/d0"}));
        assert!((400..=610).contains(&d), "{d}");
        // Pointers with escapes, and refs to nothing.
        let s = json!({"$defs": {"a/b": {"$ref": "#/$defs/x~1y"}, "x/y": {"type": "string"}}, "$ref": "#/$defs/a~1b"});
        assert!(schema_depth(&s) >= 4);
        assert_eq!(schema_depth(&json!({"$ref": "http://example.com/s.json"})), 1);
    }

    #[test]
    fn lark_depth_counts_rule_chains() {
        let chain = |n: usize| {
            let rules: Vec<String> = (0..n).map(|i| format!("r{i}: r{}", i + 1)).collect();
            format!("start: r0\n{}\nr{n}: \"x\"\n", rules.join("\n"))
        };
        let d = lark_depth(&chain(1000));
        assert!((1000..=1003).contains(&d), "{d}");
        assert_eq!(lark_depth("start: \"a\" | \"b\"\n"), 1);
        // Recursion is a cycle, not depth: start -> list -> item -> NUMBER.
        assert_eq!(
            lark_depth("start: list\nlist: \"[\" (item (\",\" item)*)? \"]\"\nitem: NUMBER | list\nNUMBER: /[0-9]+/\n"),
            4
        );
        // Strings, regexes and comments are not references; priorities are not names.
        assert_eq!(lark_depth("start.2: \"a: b\" /c: d/ // e: f\n# g: h\n"), 1);
        // Alternatives: one more than the `|`s outside strings, regexes and comments.
        assert_eq!(lark_alternatives("start: \"a|b\" | /c|d/ | x // e | f\nx: \"y\"\n"), 3);
        // A %json schema adds its own depth.
        let j = format!("start: %json {}\n", ref_chain(50));
        assert!(lark_depth(&j) > 50);
    }

    #[test]
    fn check_names_the_bound() {
        let deep = ConstraintSpec::JsonSchema { schema: ref_chain(MAX_DEPTH + 10), strict: false };
        let e = check(&deep).unwrap_err();
        assert!(e.contains(&MAX_DEPTH.to_string()), "{e}");
        assert!(check(&ConstraintSpec::JsonSchema { schema: ref_chain(100), strict: false }).is_ok());
        let big = ConstraintSpec::Regex("a".repeat(MAX_BYTES + 1));
        assert!(check(&big).unwrap_err().contains(&MAX_BYTES.to_string()));
        assert!(check(&ConstraintSpec::Choice(vec!["x".repeat(MAX_BYTES)])).is_err());
        assert_eq!(
            json_size(&json!({"a": [1, "xy", null]})),
            serde_json::to_string(&json!({"a": [1, "xy", null]})).unwrap().len()
        );
    }
}
