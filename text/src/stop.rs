//! Stop strings over a stream of text deltas: text that might be the start of a stop string
//! is held back until it is known not to be, and the stop string itself is never emitted
//! (OpenAI's behaviour).

/// Result of feeding one text delta.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopMatch {
    /// Text that is safe to send to the client now.
    pub emit: String,
    /// Index of the stop string that matched, if any; generation ends there.
    pub stopped: Option<usize>,
}

/// Matches a set of stop strings across delta boundaries.
#[derive(Debug, Clone, Default)]
pub struct StopStringMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopStringMatcher {
    /// Empty stop strings are ignored (they would match everywhere).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Feeds the next delta.
    pub fn push(&mut self, delta: &str) -> StopMatch {
        if self.stops.is_empty() {
            return StopMatch {
                emit: delta.to_string(),
                stopped: None,
            };
        }
        self.held.push_str(delta);
        // The earliest match wins, whichever stop string it is.
        let earliest = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.held.find(s.as_str()).map(|pos| (pos, i)))
            .min();
        if let Some((pos, index)) = earliest {
            let emit = self.held[..pos].to_string();
            self.held.clear();
            return StopMatch {
                emit,
                stopped: Some(index),
            };
        }
        let keep = self.longest_partial_suffix();
        let split = self.held.len() - keep;
        let emit = self.held[..split].to_string();
        self.held.drain(..split);
        StopMatch {
            emit,
            stopped: None,
        }
    }

    /// Whatever is still held back, when generation ends for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length of the longest suffix of `held` that is a proper prefix of a stop string.
    fn longest_partial_suffix(&self) -> usize {
        let mut best = 0;
        for stop in &self.stops {
            for (k, _) in stop.char_indices().skip(1) {
                if k > best && self.held.ends_with(&stop[..k]) {
                    best = k;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], deltas: &[&str]) -> (String, Option<usize>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopStringMatcher::new(&stops);
        let mut out = String::new();
        for d in deltas {
            let r = m.push(d);
            out.push_str(&r.emit);
            if r.stopped.is_some() {
                return (out, r.stopped);
            }
        }
        out.push_str(&m.finish());
        (out, None)
    }

    #[test]
    fn stop_across_deltas_is_not_emitted() {
        assert_eq!(
            run(&["END"], &["abc E", "N", "D tail"]),
            ("abc ".into(), Some(0))
        );
        assert_eq!(
            run(&["\n\n"], &["line\n", "\nmore"]),
            ("line".into(), Some(0))
        );
    }

    #[test]
    fn false_start_is_released() {
        assert_eq!(
            run(&["END"], &["abc EN", "X more"]),
            ("abc ENX more".into(), None)
        );
        assert_eq!(run(&["END"], &["abc EN"]), ("abc EN".into(), None));
    }

    #[test]
    fn earliest_of_several_wins_and_unicode_is_safe() {
        assert_eq!(run(&["zz", "b"], &["a", "bzz"]), ("a".into(), Some(1)));
        assert_eq!(
            run(&["✓✓"], &["ok ✓", "x ✓✓ rest"]),
            ("ok ✓x ".into(), Some(0))
        );
        assert_eq!(run(&[""], &["text"]), ("text".into(), None));
    }
}
