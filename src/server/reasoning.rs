//! Reasoning output: a thinking model's `<think>...</think>` span goes to `reasoning_content`,
//! the rest to `content` (vLLM's `--reasoning-parser`, with its names).
//!
//! - `deepseek_r1`: the output starts in the thinking span (DeepSeek-R1 and its distills think
//!   first; a leading `<think>` in the output is dropped) and it ends at `</think>`; an output
//!   without `</think>` is all reasoning.
//! - `qwen3`: the output is thinking only when it opens with `<think>` (Qwen3's hybrid models),
//!   or when the rendered prompt ends inside an open `<think>` (templates that open it, such as
//!   the Qwen3 thinking-only models'); otherwise it is all content, so `enable_thinking: false`
//!   (its template closes an empty span in the prompt) gives plain content.
//!
//! - `gemma4`: Gemma 4's thinking span, `<|channel>thought` ... `<channel|>`, with `qwen3`'s
//!   rules (thinking only when the output opens the span, or the prompt left it open); picked by
//!   `auto` for a template that writes `<|channel>`.
//!
//! - `openai_gptoss`: gpt-oss's harmony channels (its own parser, server/harmony.rs, which also
//!   reads its tool calls); picked by `auto` for a template that writes `<|channel|>`.
//!
//! Streamed and whole outputs go through the same [`Splitter`], so the deltas always add up to
//! the whole response, whatever the token boundaries. Around a span, the whitespace at its start,
//! at its end and at the start of the content after it is dropped (the newlines around the
//! tags); an output without a span is content untouched.

/// `--reasoning-parser` / `reasoning_parser`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ReasoningChoice {
    /// From the chat template: one that uses `<think>` thinks (`qwen3` when it also has an
    /// `enable_thinking` switch, else `deepseek_r1`).
    #[default]
    Auto,
    None,
    Parser(ReasoningKind),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReasoningKind {
    DeepSeekR1,
    Qwen3,
    /// Gemma 4's `<|channel>thought` ... `<channel|>`.
    Gemma4,
    /// gpt-oss's harmony format (server/harmony.rs, not the [`Splitter`]).
    Harmony,
}

pub const OPEN: &str = "<think>";
pub const CLOSE: &str = "</think>";
/// Gemma 4's thinking span (Google's prompt format: a `thought` channel).
pub const GEMMA4_OPEN: &str = "<|channel>thought";
pub const GEMMA4_CLOSE: &str = "<channel|>";

impl ReasoningKind {
    /// The tags around the thinking span.
    pub fn tags(self) -> (&'static str, &'static str) {
        match self {
            ReasoningKind::Gemma4 => (GEMMA4_OPEN, GEMMA4_CLOSE),
            _ => (OPEN, CLOSE),
        }
    }
}
/// Where a harmony answer (gpt-oss) starts.
pub const HARMONY_FINAL: &str = "<|channel|>final<|message|>";

impl ReasoningChoice {
    /// The flag value that parses back to this choice.
    pub fn flag(self) -> &'static str {
        match self {
            ReasoningChoice::Auto => "auto",
            ReasoningChoice::None => "none",
            ReasoningChoice::Parser(ReasoningKind::DeepSeekR1) => "deepseek_r1",
            ReasoningChoice::Parser(ReasoningKind::Qwen3) => "qwen3",
            ReasoningChoice::Parser(ReasoningKind::Gemma4) => "gemma4",
            ReasoningChoice::Parser(ReasoningKind::Harmony) => "openai_gptoss",
        }
    }

    pub fn parse(s: &str) -> Result<ReasoningChoice, String> {
        Ok(match s {
            "auto" => ReasoningChoice::Auto,
            "none" | "off" => ReasoningChoice::None,
            "deepseek_r1" => ReasoningChoice::Parser(ReasoningKind::DeepSeekR1),
            "qwen3" => ReasoningChoice::Parser(ReasoningKind::Qwen3),
            "gemma4" => ReasoningChoice::Parser(ReasoningKind::Gemma4),
            "openai_gptoss" | "harmony" => ReasoningChoice::Parser(ReasoningKind::Harmony),
            o => {
                return Err(format!(
                    "unknown reasoning parser '{o}' (known: auto, none, deepseek_r1, qwen3, gemma4, openai_gptoss)"
                ))
            }
        })
    }

    /// The parser for a model whose chat template is `template` (None: it has none).
    pub fn resolve(self, template: Option<&str>) -> Option<ReasoningKind> {
        match self {
            ReasoningChoice::None => None,
            ReasoningChoice::Parser(k) => Some(k),
            ReasoningChoice::Auto => {
                let t = template?;
                if t.contains("<|channel|>") {
                    Some(ReasoningKind::Harmony)
                } else if t.contains("<|channel>") {
                    Some(ReasoningKind::Gemma4)
                } else if !t.contains(OPEN) {
                    None
                } else if t.contains("enable_thinking") {
                    Some(ReasoningKind::Qwen3)
                } else {
                    Some(ReasoningKind::DeepSeekR1)
                }
            }
        }
    }
}

/// How one request's output is split: the parser, and whether the rendered prompt leaves a
/// `<think>` open (the output then starts inside the span).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reasoning {
    pub kind: ReasoningKind,
    pub prompt_open: bool,
}

impl Reasoning {
    pub fn new(kind: ReasoningKind, prompt: &str) -> Reasoning {
        Reasoning { kind, prompt_open: prompt.trim_end().ends_with(kind.tags().0) }
    }

    /// Whether the output starts inside the thinking span for certain (a grammar then waits for
    /// its end: it constrains the answer, not the thinking).
    pub fn starts_thinking(&self) -> bool {
        self.prompt_open || matches!(self.kind, ReasoningKind::DeepSeekR1 | ReasoningKind::Harmony)
    }

    /// The text after which a grammar starts: the end of the thinking, or a harmony answer's
    /// header.
    pub fn answer_starts_after(&self) -> &'static str {
        match self.kind {
            ReasoningKind::Harmony => HARMONY_FINAL,
            k => k.tags().1,
        }
    }

    pub fn is_harmony(&self) -> bool {
        self.kind == ReasoningKind::Harmony
    }
}

/// A piece of split output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    Reasoning(String),
    Content(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// qwen3: not yet known whether the output opens with `<think>`.
    Undecided,
    /// In the span, before its first non-whitespace character (a leading `<think>` is dropped).
    ReasoningStart,
    Reasoning,
    /// After the span, before the content's first non-whitespace character.
    ContentStart,
    Content,
}

/// Splits output text into reasoning and content as it arrives.
pub struct Splitter {
    state: State,
    /// Text not yet given out: a possible start of a tag, or whitespace that may end the span.
    held: String,
    /// The span's tags.
    open: &'static str,
    close: &'static str,
}

impl Splitter {
    pub fn new(r: Reasoning) -> Splitter {
        let state = if r.starts_thinking() { State::ReasoningStart } else { State::Undecided };
        let (open, close) = r.kind.tags();
        Splitter { state, held: String::new(), open, close }
    }

    /// The parts `text` completes (the text is appended to what is held).
    pub fn push(&mut self, text: &str) -> Vec<Part> {
        self.held.push_str(text);
        self.drive(false)
    }

    /// The output ended: what is held is given out as it stands.
    pub fn finish(&mut self) -> Vec<Part> {
        self.drive(true)
    }

    /// Steps until nothing changes.
    fn drive(&mut self, end: bool) -> Vec<Part> {
        let mut out = Vec::new();
        loop {
            let before = (self.state, self.held.len());
            self.step(&mut out, end);
            if (self.state, self.held.len()) == before {
                break;
            }
        }
        merge(out)
    }

    fn step(&mut self, out: &mut Vec<Part>, end: bool) {
        let h = &self.held;
        let (open, close) = (self.open, self.close);
        match self.state {
            State::Undecided => {
                let t = h.trim_start();
                if let Some(rest) = t.strip_prefix(open) {
                    self.held = rest.to_string();
                    self.state = State::ReasoningStart;
                } else if end || !open.starts_with(t) {
                    // No span: the output is content as it stands.
                    self.state = State::Content;
                }
            }
            State::ReasoningStart => {
                let t = h.trim_start();
                if let Some(rest) = t.strip_prefix(open) {
                    self.held = rest.to_string();
                } else if !t.is_empty() && (end || !open.starts_with(t)) {
                    self.held = t.to_string();
                    self.state = State::Reasoning;
                } else if t.is_empty() {
                    self.held.clear();
                }
            }
            State::Reasoning => {
                if let Some(i) = h.find(close) {
                    let r = h[..i].trim_end().to_string();
                    self.held = h[i + close.len()..].to_string();
                    out.push(Part::Reasoning(r));
                    self.state = State::ContentStart;
                    return;
                }
                // Keep a possible start of `</think>`, and trailing whitespace (it may end the span).
                let keep = if end { 0 } else { held_tail(h, close) };
                let cut = h.len() - keep;
                if cut > 0 {
                    out.push(Part::Reasoning(h[..cut].to_string()));
                    self.held.drain(..cut);
                }
            }
            State::ContentStart => {
                let t = h.trim_start();
                if !t.is_empty() {
                    self.held = t.to_string();
                    self.state = State::Content;
                } else {
                    self.held.clear();
                }
            }
            State::Content => {
                if !h.is_empty() {
                    out.push(Part::Content(std::mem::take(&mut self.held)));
                }
            }
        }
    }
}

/// Bytes at the end of reasoning text `h` to hold back: trailing whitespace, or a proper
/// prefix of the closing tag `close` after it (with the whitespace before that prefix).
fn held_tail(h: &str, close: &str) -> usize {
    let mut keep = 0;
    for (i, _) in h.char_indices() {
        let s = &h[i..];
        if s.len() < close.len() && close.starts_with(s) {
            keep = s.len();
            break;
        }
    }
    let body = &h[..h.len() - keep];
    keep + (body.len() - body.trim_end().len())
}

/// Adjacent parts of one kind joined, empty ones dropped.
fn merge(parts: Vec<Part>) -> Vec<Part> {
    let mut out: Vec<Part> = Vec::new();
    for p in parts {
        match (out.last_mut(), p) {
            (_, Part::Reasoning(s) | Part::Content(s)) if s.is_empty() => {}
            (Some(Part::Reasoning(a)), Part::Reasoning(b)) => a.push_str(&b),
            (Some(Part::Content(a)), Part::Content(b)) => a.push_str(&b),
            (_, p) => out.push(p),
        }
    }
    out
}

/// A whole output split: (reasoning, content), each None when empty.
pub fn split_whole(r: Reasoning, text: &str) -> (Option<String>, Option<String>) {
    let mut s = Splitter::new(r);
    let mut parts = s.push(text);
    parts.extend(s.finish());
    joined(parts)
}

/// Parts joined by kind: (reasoning, content), each None when empty.
fn joined(parts: Vec<Part>) -> (Option<String>, Option<String>) {
    let (mut reasoning, mut content) = (String::new(), String::new());
    for p in parts {
        match p {
            Part::Reasoning(t) => reasoning.push_str(&t),
            Part::Content(t) => content.push_str(&t),
        }
    }
    let some = |s: String| (!s.is_empty()).then_some(s);
    (some(reasoning), some(content))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(kind: ReasoningKind, prompt_open: bool) -> Reasoning {
        Reasoning { kind, prompt_open }
    }

    /// The text split in pieces at every pair of cut points gives the whole split.
    fn streamed_equals_whole(rs: Reasoning, text: &str) {
        let whole = split_whole(rs, text);
        let cuts: Vec<usize> = (0..=text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        for &a in &cuts {
            for &b in cuts.iter().filter(|&&b| b >= a) {
                let mut s = Splitter::new(rs);
                let mut parts = s.push(&text[..a]);
                parts.extend(s.push(&text[a..b]));
                parts.extend(s.push(&text[b..]));
                parts.extend(s.finish());
                assert_eq!(joined(parts), whole, "{text:?} cut at {a}, {b}");
            }
        }
    }

    #[test]
    fn splits_thinking_from_the_answer() {
        let q = r(ReasoningKind::Qwen3, false);
        let some = |a: &str, b: &str| ((!a.is_empty()).then(|| a.to_string()), (!b.is_empty()).then(|| b.to_string()));
        assert_eq!(split_whole(q, "<think>\nLet me see.\n</think>\n\nIt is 4."), some("Let me see.", "It is 4."));
        // No span: all content (thinking switched off, or a model that does not think).
        assert_eq!(split_whole(q, "It is 4 < 5."), some("", "It is 4 < 5."));
        assert_eq!(split_whole(q, "<thin"), some("", "<thin"));
        // Without a span nothing is trimmed (an answer may start with indentation).
        assert_eq!(split_whole(q, "\n    x = 1"), some("", "\n    x = 1"));
        assert_eq!(split_whole(q, "  \n"), some("", "  \n"));
        // An unfinished span (max_tokens) is reasoning.
        assert_eq!(split_whole(q, "<think>hmm, 2 + 2"), some("hmm, 2 + 2", ""));
        // The prompt left <think> open: the output starts in the span.
        assert_eq!(split_whole(r(ReasoningKind::Qwen3, true), "a</think>b"), some("a", "b"));
        let d = r(ReasoningKind::DeepSeekR1, false);
        assert_eq!(split_whole(d, "a\n</think>\n\nb"), some("a", "b"));
        assert_eq!(split_whole(d, "<think>a</think>b</think>c"), some("a", "b</think>c"));
        assert_eq!(split_whole(d, "no end tag"), some("no end tag", ""));
        assert_eq!(split_whole(d, "</think>"), some("", ""));
        assert_eq!(split_whole(d, "x </thi"), some("x </thi", ""));
        // Gemma 4: its channel tags; <think> is plain text to it.
        let g = r(ReasoningKind::Gemma4, false);
        assert_eq!(split_whole(g, "<|channel>thought\nLet me see.<channel|>It is 4."), some("Let me see.", "It is 4."));
        assert_eq!(split_whole(g, "<think>a</think>b"), some("", "<think>a</think>b"));
        assert_eq!(split_whole(g, "<|channel>thought\nunfinished"), some("unfinished", ""));
        assert_eq!(split_whole(r(ReasoningKind::Gemma4, true), "a<channel|>b"), some("a", "b"));
    }

    #[test]
    fn streamed_splits_add_up_to_the_whole_at_any_boundary() {
        for rs in [r(ReasoningKind::Qwen3, false), r(ReasoningKind::Qwen3, true), r(ReasoningKind::DeepSeekR1, false)] {
            for text in [
                "<think>\nstep 1\nstep 2 </think>\n\n{\"a\": 1}",
                "  <think>é</think>ü",
                "<think>a </thinker> b</think> c",
                "plain answer <think>",
                "<think>unfinished\n",
                "x</think>y",
                "\n  indented",
                " ",
            ] {
                streamed_equals_whole(rs, text);
            }
        }
        for rs in [r(ReasoningKind::Gemma4, false), r(ReasoningKind::Gemma4, true)] {
            for text in
                ["<|channel>thought\nstep <chan 1<channel|>\n\nok", "<|chan", "x<channel|>y", "<|channel>thought é"]
            {
                streamed_equals_whole(rs, text);
            }
        }
    }

    #[test]
    fn picks_the_parser_from_the_template() {
        let auto = ReasoningChoice::Auto;
        assert_eq!(auto.resolve(Some("{% if enable_thinking %}<think>{% endif %}")), Some(ReasoningKind::Qwen3));
        assert_eq!(auto.resolve(Some("<｜Assistant｜><think>\n")), Some(ReasoningKind::DeepSeekR1));
        assert_eq!(auto.resolve(Some("<|im_start|>assistant\n")), None);
        assert_eq!(auto.resolve(Some("<|start|>assistant<|channel|>final<|message|>")), Some(ReasoningKind::Harmony));
        assert_eq!(ReasoningChoice::parse("openai_gptoss"), Ok(ReasoningChoice::Parser(ReasoningKind::Harmony)));
        assert_eq!(auto.resolve(None), None);
        assert_eq!(ReasoningChoice::None.resolve(Some("<think>")), None);
        assert_eq!(ReasoningChoice::parse("qwen3"), Ok(ReasoningChoice::Parser(ReasoningKind::Qwen3)));
        assert!(ReasoningChoice::parse("r1").unwrap_err().contains("deepseek_r1"));
        assert!(Reasoning::new(ReasoningKind::Qwen3, "<|im_start|>assistant\n<think>\n").prompt_open);
        assert!(!Reasoning::new(ReasoningKind::Qwen3, "assistant\n<think>\n\n</think>\n\n").prompt_open);
        let gemma4 = "{{ bos_token }}<|turn>model\n{% if enable_thinking %}<|channel>thought\n{% endif %}";
        assert_eq!(auto.resolve(Some(gemma4)), Some(ReasoningKind::Gemma4));
        assert_eq!(ReasoningChoice::parse("gemma4"), Ok(ReasoningChoice::Parser(ReasoningKind::Gemma4)));
        assert!(Reasoning::new(ReasoningKind::Gemma4, "<|turn>model\n<|channel>thought\n").prompt_open);
    }
}
