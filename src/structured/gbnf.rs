//! llama.cpp's GBNF grammars (`root ::= ...`) as Lark grammars in llguidance's dialect, so that
//! llama-server's `grammar` field runs through the same constrained decoding as everything else.
//!
//! GBNF: rules `name ::= alternatives`, names of letters, digits and `-`; alternatives `|`,
//! sequences, groups `( ... )`, `*` `+` `?` `{m}` `{m,}` `{m,n}`; string literals `"..."` and
//! character classes `[...]` / `[^...]` with `\n \r \t \\ \" \] \xHH \uHHHH \UHHHHHHHH` escapes;
//! `.` (any character); `#` comments. A rule ends at a line break unless a group is open or the
//! line ends in `|`. `root` is where the output starts.
//!
//! Lark: each rule becomes `r<N>_<name>: ...` (lower case; Lark's upper-case names are
//! terminals), `start: r0_root`; strings as JSON-escaped literals, classes and `.` as regexes.
//! Errors say the line and column. Groups nest at most [`MAX_DEPTH`] deep.

use std::collections::HashMap;
use std::fmt;

/// How deep groups may nest.
pub const MAX_DEPTH: usize = 64;

/// A GBNF grammar that could not be read: where and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GbnfError {
    pub line: usize,
    pub col: usize,
    pub msg: String,
}

impl fmt::Display for GbnfError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GBNF grammar, line {} column {}: {}", self.line, self.col, self.msg)
    }
}

impl std::error::Error for GbnfError {}

struct Parser<'a> {
    s: &'a [char],
    at: usize,
    names: HashMap<String, String>,
    /// Rule names referred to, with where (to report one never defined).
    used: Vec<(String, usize)>,
}

/// `src` (GBNF) as a Lark grammar.
pub fn gbnf_to_lark(src: &str) -> Result<String, GbnfError> {
    let chars: Vec<char> = src.chars().collect();
    let mut p = Parser { s: &chars, at: 0, names: HashMap::new(), used: Vec::new() };
    let mut rules: Vec<(String, String)> = Vec::new();
    let mut defined: HashMap<String, usize> = HashMap::new();
    loop {
        p.space(true);
        if p.at >= p.s.len() {
            break;
        }
        let start = p.at;
        let name = p.name()?;
        p.space(false);
        if !p.eat_str("::=") {
            return Err(p.error("expected `::=` after the rule's name"));
        }
        p.space(true);
        let lark = p.lark_name(&name);
        let body = p.alternatives(0)?;
        if defined.insert(name.clone(), start).is_some() {
            return Err(p.error_at(start, format!("rule `{name}` is defined twice")));
        }
        rules.push((lark, body));
        p.space(false);
        match p.peek() {
            None | Some('\n') | Some('\r') => {}
            Some(c) => return Err(p.error(format!("unexpected `{c}`"))),
        }
    }
    if !defined.contains_key("root") {
        return Err(GbnfError { line: 1, col: 1, msg: "the grammar has no `root` rule".into() });
    }
    if let Some((n, at)) = p.used.iter().find(|(n, _)| !defined.contains_key(n)) {
        return Err(p.error_at(*at, format!("rule `{n}` is used but never defined")));
    }
    let mut out = format!("start: {}\n", p.lark_name("root"));
    for (name, body) in rules {
        out.push_str(&format!("{name}: {body}\n"));
    }
    Ok(out)
}

impl Parser<'_> {
    fn peek(&self) -> Option<char> {
        self.s.get(self.at).copied()
    }

    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn eat_str(&mut self, t: &str) -> bool {
        let t: Vec<char> = t.chars().collect();
        if self.s[self.at..].starts_with(&t) {
            self.at += t.len();
            true
        } else {
            false
        }
    }

    fn error(&self, msg: impl Into<String>) -> GbnfError {
        self.error_at(self.at, msg)
    }

    fn error_at(&self, at: usize, msg: impl Into<String>) -> GbnfError {
        let before = &self.s[..at.min(self.s.len())];
        let line = before.iter().filter(|&&c| c == '\n').count() + 1;
        let col = before.iter().rev().take_while(|&&c| c != '\n').count() + 1;
        GbnfError { line, col, msg: msg.into() }
    }

    /// Spaces, tabs and comments; line breaks too with `newlines`.
    fn space(&mut self, newlines: bool) {
        while let Some(c) = self.peek() {
            match c {
                ' ' | '\t' => self.at += 1,
                '\n' | '\r' if newlines => self.at += 1,
                '#' => {
                    while self.peek().is_some_and(|c| c != '\n') {
                        self.at += 1;
                    }
                }
                _ => break,
            }
        }
    }

    fn name(&mut self) -> Result<String, GbnfError> {
        let start = self.at;
        while self.peek().is_some_and(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') {
            self.at += 1;
        }
        if self.at == start {
            return Err(self.error("expected a rule name"));
        }
        Ok(self.s[start..self.at].iter().collect())
    }

    /// The Lark name of GBNF rule `name` (one per name, in order of first mention).
    fn lark_name(&mut self, name: &str) -> String {
        let n = self.names.len();
        self.names
            .entry(name.to_string())
            .or_insert_with(|| format!("r{n}_{}", name.to_ascii_lowercase().replace('-', "_")))
            .clone()
    }

    fn alternatives(&mut self, depth: usize) -> Result<String, GbnfError> {
        let mut alts = vec![self.sequence(depth)?];
        while self.eat('|') {
            self.space(true);
            alts.push(self.sequence(depth)?);
        }
        Ok(alts.join(" | "))
    }

    fn sequence(&mut self, depth: usize) -> Result<String, GbnfError> {
        let mut items = Vec::new();
        loop {
            self.space(depth > 0);
            let start = self.at;
            let item = match self.peek() {
                Some('"') => self.string()?,
                Some('[') => self.class()?,
                Some('.') => {
                    self.at += 1;
                    "/(?s:.)/".to_string()
                }
                Some('(') => {
                    if depth >= MAX_DEPTH {
                        return Err(self.error(format!("groups nest more than {MAX_DEPTH} deep")));
                    }
                    self.at += 1;
                    self.space(true);
                    let inner = self.alternatives(depth + 1)?;
                    self.space(true);
                    if !self.eat(')') {
                        return Err(self.error("expected `)`"));
                    }
                    format!("({inner})")
                }
                Some(c) if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                    let name = self.name()?;
                    // Not a reference but the next rule's head: the sequence ends here.
                    let save = self.at;
                    self.space(false);
                    if self.s[self.at..].starts_with(&[':', ':', '=']) {
                        self.at = start;
                        break;
                    }
                    self.at = save;
                    self.used.push((name.clone(), start));
                    self.lark_name(&name)
                }
                _ => break,
            };
            items.push(item + &self.postfix()?);
        }
        Ok(if items.is_empty() { "\"\"".to_string() } else { items.join(" ") })
    }

    fn postfix(&mut self) -> Result<String, GbnfError> {
        let mut out = String::new();
        loop {
            match self.peek() {
                Some(c @ ('*' | '+' | '?')) => {
                    self.at += 1;
                    out.push(c);
                }
                Some('{') => {
                    let start = self.at;
                    self.at += 1;
                    let body: String = std::iter::from_fn(|| {
                        let c = self.peek().filter(|&c| c != '}')?;
                        self.at += 1;
                        Some(c)
                    })
                    .collect();
                    if !self.eat('}') {
                        return Err(self.error_at(start, "expected `}` closing a repetition"));
                    }
                    let parts: Vec<&str> = body.split(',').map(str::trim).collect();
                    let num = |s: &str| s.parse::<u32>().ok().filter(|&n| n <= 10_000);
                    let ok = match parts.as_slice() {
                        [m] => num(m).is_some(),
                        [m, n] => num(m).is_some() && (n.is_empty() || num(n).is_some_and(|n| Some(n) >= num(m))),
                        _ => false,
                    };
                    if !ok {
                        return Err(self.error_at(start, format!("`{{{body}}}` is not a repetition count")));
                    }
                    out.push_str(&format!("{{{}}}", parts.join(",")));
                }
                _ => return Ok(out),
            }
        }
    }

    /// One character of a literal or class, escapes read.
    fn char_in(&mut self, end: char) -> Result<char, GbnfError> {
        let start = self.at;
        let c = self.peek().ok_or_else(|| self.error(format!("unterminated: expected `{end}`")))?;
        self.at += 1;
        if c != '\\' {
            return Ok(c);
        }
        let e = self.peek().ok_or_else(|| self.error("an escape at the end of the grammar"))?;
        self.at += 1;
        let hex = |p: &mut Self, n: usize| -> Result<char, GbnfError> {
            let digits: String = p.s[p.at..].iter().take(n).collect();
            p.at += digits.chars().count();
            u32::from_str_radix(&digits, 16)
                .ok()
                .filter(|_| digits.len() == n)
                .and_then(char::from_u32)
                .ok_or_else(|| p.error_at(start, format!("`\\{e}{digits}` is not a character")))
        };
        match e {
            'n' => Ok('\n'),
            'r' => Ok('\r'),
            't' => Ok('\t'),
            'x' => hex(self, 2),
            'u' => hex(self, 4),
            'U' => hex(self, 8),
            '\\' | '"' | ']' | '[' | '-' | '^' => Ok(e),
            _ => Err(self.error_at(start, format!("unknown escape `\\{e}`"))),
        }
    }

    fn string(&mut self) -> Result<String, GbnfError> {
        self.at += 1;
        let mut text = String::new();
        loop {
            if self.peek() == Some('"') {
                self.at += 1;
                break;
            }
            if self.peek() == Some('\n') || self.peek().is_none() {
                return Err(self.error("unterminated string: expected `\"`"));
            }
            text.push(self.char_in('"')?);
        }
        Ok(if text.is_empty() { "\"\"".to_string() } else { serde_json::Value::String(text).to_string() })
    }

    fn class(&mut self) -> Result<String, GbnfError> {
        let start = self.at;
        self.at += 1;
        let negated = self.eat('^');
        let mut out = String::from(if negated { "/[^" } else { "/[" });
        let mut any = false;
        loop {
            match self.peek() {
                Some(']') => {
                    self.at += 1;
                    break;
                }
                None | Some('\n') => return Err(self.error_at(start, "unterminated character class: expected `]`")),
                _ => {}
            }
            let a = self.char_in(']')?;
            out.push_str(&regex_char(a));
            if self.peek() == Some('-') && self.s.get(self.at + 1).is_some_and(|&c| c != ']') {
                self.at += 1;
                let b = self.char_in(']')?;
                if b < a {
                    return Err(self.error_at(start, format!("the range `{a}-{b}` is backwards")));
                }
                out.push('-');
                out.push_str(&regex_char(b));
            }
            any = true;
        }
        if !any {
            return Err(self.error_at(start, "an empty character class"));
        }
        out.push_str("]/");
        Ok(out)
    }
}

/// A character inside a regex class: letters and digits as they are, anything else by its code
/// (safe in the `regex` crate's syntax and inside Lark's `/.../`).
fn regex_char(c: char) -> String {
    if c.is_ascii_alphanumeric() {
        c.to_string()
    } else {
        format!("\\x{{{:X}}}", c as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grammars_become_lark() {
        let g = "root ::= answer ws\nanswer ::= \"yes\" | \"no\" # a comment\nws ::= [ \\t\\n]*\n";
        assert_eq!(
            gbnf_to_lark(g).unwrap(),
            "start: r0_root\nr0_root: r1_answer r2_ws\nr1_answer: \"yes\" | \"no\"\nr2_ws: /[\\x{20}\\x{9}\\x{A}]/*\n"
        );
        let g = "root ::= (\n  [a-z]+ |\n  \"x\\u00e9\" \n){2,3} item-List?\nitem-List ::= [^\"\\\\] .";
        assert_eq!(
            gbnf_to_lark(g).unwrap(),
            "start: r0_root\nr0_root: (/[a-z]/+ | \"xé\"){2,3} r1_item_list?\nr1_item_list: /[^\\x{22}\\x{5C}]/ /(?s:.)/\n"
        );
    }

    #[test]
    fn errors_say_where() {
        for (g, line, col, what) in [
            ("root ::= \"a\" | other", 1, 16, "never defined"),
            ("root ::= \"a\"\nroot ::= \"b\"", 2, 1, "twice"),
            ("item ::= \"a\"", 1, 1, "no `root`"),
            ("root ::= [a-", 1, 10, "unterminated character class"),
            ("root ::= \"abc", 1, 14, "unterminated string"),
            ("root ::= (\"a\"", 1, 14, "expected `)`"),
            ("root = \"a\"", 1, 6, "expected `::=`"),
            ("root ::= \"a\"{x}", 1, 13, "not a repetition count"),
            ("root ::= [z-a]", 1, 10, "backwards"),
            ("root ::= \"\\q\"", 1, 11, "unknown escape"),
            ("root ::= \"a\" )", 1, 14, "unexpected `)`"),
        ] {
            let e = gbnf_to_lark(g).unwrap_err();
            assert_eq!((e.line, e.col), (line, col), "{g:?}: {e}");
            assert!(e.msg.contains(what), "{g:?}: {e}");
        }
        let deep = format!("root ::= {}\"a\"{}", "(".repeat(MAX_DEPTH + 1), ")".repeat(MAX_DEPTH + 1));
        assert!(gbnf_to_lark(&deep).unwrap_err().msg.contains("nest"));
        let fine = format!("root ::= {}\"a\"{}", "(".repeat(MAX_DEPTH), ")".repeat(MAX_DEPTH));
        assert!(gbnf_to_lark(&fine).is_ok());
    }
}
