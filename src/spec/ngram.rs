//! Prompt lookup (vLLM's `ngram`, llama.cpp's lookup decoding): the sequence's last n tokens
//! (n from `max` down to `min`) are looked for earlier in its own prompt and output; at the
//! most recent earlier match, the tokens that followed it are the proposal. Code edits, quotes
//! and summaries repeat their input, so such guesses are often right; no model is needed.

/// Up to `k` tokens that followed the most recent earlier occurrence of the longest suffix of
/// `tokens` of `min..=max` tokens (empty when none occurs).
pub fn lookup(tokens: &[u32], k: usize, min: usize, max: usize) -> Vec<u32> {
    let len = tokens.len();
    if k == 0 || min == 0 {
        return Vec::new();
    }
    for n in (min..=max.min(len.saturating_sub(1))).rev() {
        let pattern = &tokens[len - n..];
        // Candidates end before the suffix itself: start s with s + n < len.
        if let Some(s) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == pattern) {
            let from = s + n;
            return tokens[from..(from + k).min(len)].to_vec();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::lookup;

    #[test]
    fn longest_recent_match_proposes_what_followed() {
        // "a b c d x a b c" -> the suffix "a b c" occurred at 0: propose "d x a".
        let t = [1, 2, 3, 4, 9, 1, 2, 3];
        assert_eq!(lookup(&t, 3, 1, 3), vec![4, 9, 1]);
        // k longer than what follows: only what there is.
        assert_eq!(lookup(&t, 10, 1, 3), vec![4, 9, 1, 2, 3]);
        // The most recent earlier match wins: "5 6" followed by 7 then by 8.
        let t = [5, 6, 7, 5, 6, 8, 5, 6];
        assert_eq!(lookup(&t, 1, 2, 2), vec![8]);
        // A longer n is preferred to a more recent shorter one: "1 2" -> 3, "2" alone -> 9.
        let t = [1, 2, 3, 2, 9, 1, 2];
        assert_eq!(lookup(&t, 1, 1, 2), vec![3]);
        assert_eq!(lookup(&t, 1, 1, 1), vec![9]);
        // No match of at least min tokens: nothing.
        assert!(lookup(&[1, 2, 3, 4], 3, 2, 4).is_empty());
        assert!(lookup(&[7], 3, 1, 4).is_empty());
        assert!(lookup(&[], 3, 1, 4).is_empty());
        assert!(lookup(&[1, 1], 0, 1, 4).is_empty());
        // A run of one token proposes more of it.
        assert_eq!(lookup(&[4, 4, 4], 2, 1, 3), vec![4]);
    }
}
