//! A small POSIX shell tokeniser: enough to find the simple commands of a `sh -c` script and
//! their words with byte spans (quotes, escapes, expansions, heredocs, redirections).

/// One word of a shell script.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Word {
    /// The word with quotes and escapes removed (expansions kept literally).
    pub(super) text: String,
    pub(super) start: usize,
    pub(super) end: usize,
    /// Contains an unquoted or double-quoted expansion (`$x`, `${x}`, `$(…)`, backticks).
    pub(super) expansion: bool,
    /// The word is exactly `"$@"`, `$@`, `"${@}"` or `${@}`.
    pub(super) dollar_at: bool,
}

/// The words of one simple command (separated by newlines, `;`, `&`, `|`, parentheses or a
/// redirection).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Segment {
    pub(super) words: Vec<Word>,
}

struct Lexer<'a> {
    s: &'a str,
    b: &'a [u8],
    i: usize,
    segments: Vec<Segment>,
    cur: Segment,
    heredocs: Vec<(String, bool)>,
}

/// Tokenises `script` into simple commands. Errors name an unterminated quote or substitution.
pub(super) fn lex(script: &str) -> Result<Vec<Segment>, String> {
    let mut lx = Lexer {
        s: script,
        b: script.as_bytes(),
        i: 0,
        segments: Vec::new(),
        cur: Segment::default(),
        heredocs: Vec::new(),
    };
    lx.run()?;
    Ok(lx.segments)
}

impl Lexer<'_> {
    fn end_segment(&mut self) {
        if !self.cur.words.is_empty() {
            self.segments.push(std::mem::take(&mut self.cur));
        }
    }

    fn peek(&self, off: usize) -> Option<u8> {
        self.b.get(self.i + off).copied()
    }

    fn run(&mut self) -> Result<(), String> {
        while self.i < self.b.len() {
            let c = self.b[self.i];
            match c {
                b' ' | b'\t' => self.i += 1,
                b'\\' if self.peek(1) == Some(b'\n') => self.i += 2,
                b'\n' => {
                    self.end_segment();
                    self.i += 1;
                    self.skip_heredocs();
                }
                b'#' => {
                    while self.i < self.b.len() && self.b[self.i] != b'\n' {
                        self.i += 1;
                    }
                }
                b';' | b'&' | b'|' | b'(' | b')' => {
                    self.end_segment();
                    self.i += 1;
                }
                b'<' | b'>' => {
                    self.end_segment();
                    self.redirection()?;
                }
                _ => {
                    let w = self.word()?;
                    // `2>&1`: a number directly before a redirection is a file descriptor.
                    if matches!(self.peek(0), Some(b'<') | Some(b'>'))
                        && !w.text.is_empty()
                        && w.text.bytes().all(|d| d.is_ascii_digit())
                        && w.end - w.start == w.text.len()
                    {
                        self.end_segment();
                        self.redirection()?;
                    } else {
                        self.cur.words.push(w);
                    }
                }
            }
        }
        self.end_segment();
        Ok(())
    }

    /// At `<` or `>`: consumes the operator and its target word; records heredocs.
    fn redirection(&mut self) -> Result<(), String> {
        let heredoc = self.peek(0) == Some(b'<') && self.peek(1) == Some(b'<');
        let mut strip_tabs = false;
        if heredoc {
            self.i += 2;
            if self.peek(0) == Some(b'-') {
                strip_tabs = true;
                self.i += 1;
            } else if self.peek(0) == Some(b'<') {
                // here-string `<<<`: the next word is the string.
                self.i += 1;
                self.skip_blanks();
                if self.i < self.b.len() && !matches!(self.b[self.i], b'\n' | b';' | b'&' | b'|') {
                    self.word()?;
                }
                return Ok(());
            }
        } else {
            while matches!(
                self.peek(0),
                Some(b'<') | Some(b'>') | Some(b'&') | Some(b'|')
            ) {
                self.i += 1;
            }
        }
        self.skip_blanks();
        if self.i < self.b.len() && !matches!(self.b[self.i], b'\n' | b';' | b'&' | b'|') {
            let target = self.word()?;
            if heredoc {
                self.heredocs.push((target.text, strip_tabs));
            }
        }
        Ok(())
    }

    fn skip_blanks(&mut self) {
        while matches!(self.peek(0), Some(b' ') | Some(b'\t')) {
            self.i += 1;
        }
    }

    /// After a newline: skips pending heredoc bodies.
    fn skip_heredocs(&mut self) {
        let pending = std::mem::take(&mut self.heredocs);
        for (delim, strip_tabs) in pending {
            loop {
                if self.i >= self.b.len() {
                    return;
                }
                let line_end = self.s[self.i..]
                    .find('\n')
                    .map(|p| self.i + p)
                    .unwrap_or(self.b.len());
                let line = &self.s[self.i..line_end];
                let line = if strip_tabs {
                    line.trim_start_matches('\t')
                } else {
                    line
                };
                self.i = (line_end + 1).min(self.b.len());
                if line == delim {
                    break;
                }
            }
        }
    }

    /// Reads one word starting at the current position.
    fn word(&mut self) -> Result<Word, String> {
        let start = self.i;
        let mut text = String::new();
        let mut expansion = false;
        while self.i < self.b.len() {
            let c = self.b[self.i];
            match c {
                b' ' | b'\t' | b'\n' | b';' | b'&' | b'|' | b'(' | b')' | b'<' | b'>' => break,
                b'\'' => {
                    let close = self.s[self.i + 1..]
                        .find('\'')
                        .ok_or_else(|| format!("unterminated single quote at byte {}", self.i))?;
                    text.push_str(&self.s[self.i + 1..self.i + 1 + close]);
                    self.i += close + 2;
                }
                b'"' => {
                    self.i += 1;
                    loop {
                        let Some(d) = self.peek(0) else {
                            return Err(format!("unterminated double quote at byte {start}"));
                        };
                        match d {
                            b'"' => {
                                self.i += 1;
                                break;
                            }
                            b'\\' => match self.peek(1) {
                                Some(b'\n') => self.i += 2,
                                Some(e @ (b'$' | b'`' | b'"' | b'\\')) => {
                                    text.push(e as char);
                                    self.i += 2;
                                }
                                _ => {
                                    text.push('\\');
                                    self.i += 1;
                                }
                            },
                            b'$' | b'`' => {
                                expansion = true;
                                let from = self.i;
                                self.expansion()?;
                                text.push_str(&self.s[from..self.i]);
                            }
                            _ => {
                                let ch = self.s[self.i..].chars().next().unwrap_or('\u{fffd}');
                                text.push(ch);
                                self.i += ch.len_utf8().max(1);
                            }
                        }
                    }
                }
                b'\\' => match self.peek(1) {
                    Some(b'\n') => self.i += 2,
                    Some(_) => {
                        let ch = self.s[self.i + 1..].chars().next().unwrap_or('\u{fffd}');
                        text.push(ch);
                        self.i += 1 + ch.len_utf8().max(1);
                    }
                    None => {
                        self.i += 1;
                    }
                },
                b'$' | b'`' => {
                    expansion = true;
                    let from = self.i;
                    self.expansion()?;
                    text.push_str(&self.s[from..self.i]);
                }
                _ => {
                    let ch = self.s[self.i..].chars().next().unwrap_or('\u{fffd}');
                    text.push(ch);
                    self.i += ch.len_utf8().max(1);
                }
            }
        }
        let raw = &self.s[start..self.i];
        let dollar_at = matches!(raw, "\"$@\"" | "$@" | "\"${@}\"" | "${@}");
        Ok(Word {
            text,
            start,
            end: self.i,
            expansion,
            dollar_at,
        })
    }

    /// At `$` or a backtick: skips the expansion.
    fn expansion(&mut self) -> Result<(), String> {
        let c = self.b[self.i];
        if c == b'`' {
            let close = self.s[self.i + 1..]
                .find('`')
                .ok_or_else(|| format!("unterminated backquote at byte {}", self.i))?;
            self.i += close + 2;
            return Ok(());
        }
        // `$`
        match self.peek(1) {
            Some(b'(') => {
                self.i += 1;
                self.balanced(b'(', b')')
            }
            Some(b'{') => {
                self.i += 1;
                self.balanced(b'{', b'}')
            }
            Some(d) if d.is_ascii_alphabetic() || d == b'_' => {
                self.i += 1;
                while matches!(self.peek(0), Some(x) if x.is_ascii_alphanumeric() || x == b'_') {
                    self.i += 1;
                }
                Ok(())
            }
            Some(b'@' | b'*' | b'#' | b'?' | b'-' | b'$' | b'!' | b'0'..=b'9') => {
                self.i += 2;
                Ok(())
            }
            _ => {
                // A lone `$` is literal.
                self.i += 1;
                Ok(())
            }
        }
    }

    /// At `open`: skips to the matching `close`, respecting quotes.
    fn balanced(&mut self, open: u8, close: u8) -> Result<(), String> {
        let start = self.i;
        let mut depth = 0usize;
        while self.i < self.b.len() {
            let c = self.b[self.i];
            match c {
                b'\\' => self.i += 2,
                b'\'' => {
                    let close_at = self.s[self.i + 1..]
                        .find('\'')
                        .ok_or_else(|| format!("unterminated single quote at byte {}", self.i))?;
                    self.i += close_at + 2;
                }
                b'"' => {
                    self.i += 1;
                    while self.i < self.b.len() && self.b[self.i] != b'"' {
                        if self.b[self.i] == b'\\' {
                            self.i += 1;
                        }
                        self.i += 1;
                    }
                    self.i += 1;
                }
                _ if c == open => {
                    depth += 1;
                    self.i += 1;
                }
                _ if c == close => {
                    depth = depth.saturating_sub(1);
                    self.i += 1;
                    if depth == 0 {
                        return Ok(());
                    }
                }
                _ => self.i += 1,
            }
        }
        Err(format!(
            "unterminated substitution starting at byte {start}"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lexes_words_quotes_and_operators() {
        let segs =
            lex("pip install x && exec vllm serve 'm o' --a \"b c\" # hi\necho $X; true").unwrap();
        let texts: Vec<Vec<&str>> = segs
            .iter()
            .map(|s| s.words.iter().map(|w| w.text.as_str()).collect())
            .collect();
        assert_eq!(
            texts,
            vec![
                vec!["pip", "install", "x"],
                vec!["exec", "vllm", "serve", "m o", "--a", "b c"],
                vec!["echo", "$X"],
                vec!["true"],
            ]
        );
        assert!(segs[2].words[1].expansion);
    }

    #[test]
    fn lexes_continuations_and_heredocs() {
        let segs =
            lex("cat > f <<'EOF'\nvllm serve nope\nEOF\nvllm serve m \\\n  --port 1 \\\n").unwrap();
        let texts: Vec<Vec<&str>> = segs
            .iter()
            .map(|s| s.words.iter().map(|w| w.text.as_str()).collect())
            .collect();
        assert_eq!(
            texts,
            vec![vec!["cat"], vec!["vllm", "serve", "m", "--port", "1"]]
        );
    }

    #[test]
    fn lex_errors_on_unterminated_quote() {
        assert!(lex("vllm serve 'oops").is_err());
        assert!(lex("vllm serve $(echo").is_err());
    }
}
