//! What a forward pass costs, by its shape: a linear model in the rows that sample, the
//! other tokens (prompt chunks) and the query-key pairs attention computes, fitted by each
//! worker to the steps it runs ([`CostFit`]) and reported to the router, which predicts
//! with it ([`Coefficients`]) where a request meets its latency targets. A decode worker also
//! sizes the prompt chunks it runs beside its streams with it ([`Coefficients::chunk_allowance`]).
//!
//! Why this shape: on both backends a pass costs a fixed part (launches, threads waking,
//! the norm and head weights read once), a part per token (every weight matrix multiplied by
//! every row, which at batch 1 is the weight read), a part per sampled row (the vocabulary
//! head and sampling), and attention, which grows with each row's context. Four numbers a
//! worker can fit from a few dozen steps, and a router can evaluate for a pass that has not
//! happened.
//!
//! A crate of its own, with no dependencies, so that the workers (which fit) and the router
//! (which predicts) share one definition without the router taking the engine.

mod pacing;

pub use pacing::{
    DEBT_HORIZON, MIN_PACED_CHUNK, Pacing, PassBudget, Standing, Waiting, idle_ms, least_lead_ms,
    least_target_lead_ms, lone_pass_allowance, paced_prompt_ms, pass_budget,
};

/// The longest a paced pass may take, in its tightest stream's targets, however much room
/// the streams have: whatever arrives meanwhile (a new stream's prompt, with a TTFT target
/// of about a second) waits for the pass under way.
pub const LONGEST_PASS_TARGETS: f64 = 5.0;

/// When the streams' passes alone fill their aim, a waiting prompt still gets one granule
/// every this many passes (`Pacing`): late, never starved.
pub const STARVED_PASSES: u64 = 8;

/// The share of a TPOT target that a decode worker fills a pass to when it lends its
/// streams' slack to a prompt chunk: the fit's error and the passes' noise stay within the
/// rest. The router predicts with the same share.
pub const TPOT_HEADROOM: f64 = 0.9;

/// Prompt tokens a fit must have seen (decayed, see [`CostFit::prompt_tokens_seen`]) before
/// its price of a prompt is used: a few short chunks are noise. Whatever the fit then puts
/// that price on (per token, or per attention pair when its prompts all had one length) is
/// its price.
pub const MIN_PROMPT_TOKENS_SEEN: f64 = 1024.0;

/// The shape of one forward pass.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepShape {
    /// Rows whose logits the pass computes: decode rows, and the last chunk of a prompt.
    pub sampled_rows: f64,
    /// Tokens the pass runs besides those rows (prompt chunks).
    pub other_tokens: f64,
    /// Query-key pairs attention computes, in millions.
    pub attention_mpairs: f64,
}

impl StepShape {
    /// `rows` decode rows whose contexts add up to `context_tokens`.
    pub fn decode(rows: u64, context_tokens: u64) -> Self {
        Self {
            sampled_rows: rows as f64,
            other_tokens: 0.0,
            attention_mpairs: context_tokens as f64 / 1e6,
        }
    }

    /// A chunk of `len` prompt tokens after `start` computed ones; `samples` when it ends the
    /// prompt (its last row's logits are computed).
    pub fn chunk(start: u64, len: u64, samples: bool) -> Self {
        let (start, len) = (start as f64, len as f64);
        let sampled = if samples && len > 0.0 { 1.0 } else { 0.0 };
        Self {
            sampled_rows: sampled,
            other_tokens: len - sampled,
            // Row i of the chunk attends to start + i + 1 keys.
            attention_mpairs: (len * start + len * (len + 1.0) / 2.0) / 1e6,
        }
    }

    /// The pass that runs both.
    pub fn plus(self, other: Self) -> Self {
        Self {
            sampled_rows: self.sampled_rows + other.sampled_rows,
            other_tokens: self.other_tokens + other.other_tokens,
            attention_mpairs: self.attention_mpairs + other.attention_mpairs,
        }
    }

    fn features(&self) -> [f64; 4] {
        [
            1.0,
            self.sampled_rows,
            self.other_tokens,
            self.attention_mpairs,
        ]
    }
}

/// A fitted cost model: milliseconds per pass, per sampled row, per other token and per
/// million attention pairs. A coefficient the worker has had no steps to fit is 0.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Coefficients {
    pub base_ms: f64,
    pub per_row_ms: f64,
    pub per_token_ms: f64,
    pub per_mpair_ms: f64,
}

impl Coefficients {
    /// The predicted time of a pass of this shape.
    pub fn step_ms(&self, shape: &StepShape) -> f64 {
        let x = shape.features();
        self.base_ms * x[0]
            + self.per_row_ms * x[1]
            + self.per_token_ms * x[2]
            + self.per_mpair_ms * x[3]
    }

    /// Whether the fit puts a price on prompt tokens of their own (a fit that has seen
    /// prompts may still put their whole cost on attention; see [`MIN_PROMPT_TOKENS_SEEN`]).
    pub fn knows_prompts(&self) -> bool {
        self.per_token_ms > 0.0
    }

    /// Whether the fit has seen any pass at all.
    pub fn is_fitted(&self) -> bool {
        self.step_ms(&StepShape::decode(1, 1)) > 0.0
    }

    /// The time to compute prompt tokens `start..start + tokens` in chunks of at most
    /// `chunk` tokens, each pass also running `beside` (the decode rows that share it), and
    /// the number of passes. The last chunk samples.
    pub fn prompt_ms(&self, beside: StepShape, start: u64, tokens: u64, chunk: u64) -> (f64, u64) {
        let chunk = chunk.max(1);
        let (mut at, end) = (start, start.saturating_add(tokens));
        let (mut total, mut passes) = (0.0, 0u64);
        while at < end {
            let len = chunk.min(end - at);
            let shape = beside.plus(StepShape::chunk(at, len, at + len == end));
            total += self.step_ms(&shape);
            passes += 1;
            at += len;
        }
        (total, passes)
    }

    /// The most prompt tokens (a multiple of `granule`, at most `max`) that a pass running
    /// `beside` can add after `start` computed prompt tokens and still take at most
    /// `target_ms`: 0 when not even a granule fits; `max` when the fit cannot price prompt
    /// tokens.
    pub fn chunk_allowance(
        &self,
        beside: StepShape,
        start: u64,
        target_ms: f64,
        max: u64,
        granule: u64,
    ) -> u64 {
        let granule = granule.max(1);
        let max = max.max(granule);
        // A chunk that costs nothing beside the streams (no prompt seen, or none priced) is
        // not capped.
        let granule_ms = self.step_ms(&beside.plus(StepShape::chunk(start, granule, false)))
            - self.step_ms(&beside);
        if granule_ms <= 0.0 || !target_ms.is_finite() {
            return max;
        }
        let fits = |granules: u64| {
            let shape = beside.plus(StepShape::chunk(start, granules * granule, false));
            self.step_ms(&shape) <= target_ms
        };
        // The cost grows with the chunk: bisect over whole granules.
        let (mut lo, mut hi) = (1u64, max / granule);
        if !fits(lo) {
            return 0;
        }
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if fits(mid) { lo = mid } else { hi = mid - 1 }
        }
        lo * granule
    }
}

/// How much a fit forgets per pass: about the last thousand passes count.
pub const DEFAULT_DECAY: f64 = 0.999;

/// A least-squares fit of [`Coefficients`] to observed passes, older passes weighing less
/// (the load on a shared host changes), with every coefficient held non-negative.
#[derive(Debug, Clone)]
pub struct CostFit {
    xtx: [[f64; 4]; 4],
    xty: [f64; 4],
    decay: f64,
    passes: u64,
    /// Prompt tokens (other tokens) in the passes the fit remembers, decayed like them.
    prompt_tokens: f64,
}

impl Default for CostFit {
    fn default() -> Self {
        Self::new(DEFAULT_DECAY)
    }
}

impl CostFit {
    /// A fit whose older passes weigh `decay` times less per pass (clamped to (0, 1]).
    pub fn new(decay: f64) -> Self {
        let decay = if decay.is_finite() {
            decay.clamp(0.5, 1.0)
        } else {
            DEFAULT_DECAY
        };
        Self {
            xtx: [[0.0; 4]; 4],
            xty: [0.0; 4],
            decay,
            passes: 0,
            prompt_tokens: 0.0,
        }
    }

    /// Passes observed so far.
    pub fn passes(&self) -> u64 {
        self.passes
    }

    /// Adds a pass of `shape` that took `ms` (ignored when not a finite, non-negative time).
    pub fn observe(&mut self, shape: &StepShape, ms: f64) {
        self.observe_weighted(shape, ms, 1.0);
    }

    /// [`CostFit::observe`] for a pass that counts `weight` times a real one in the fit
    /// (a worker's start-up calibration: it gives the fit shapes to tell its costs apart,
    /// while the real passes, which may run beside other work on the same cores, soon set
    /// their level). Its prompt tokens count in full in [`CostFit::prompt_tokens_seen`].
    pub fn observe_weighted(&mut self, shape: &StepShape, ms: f64, weight: f64) {
        if !ms.is_finite() || ms < 0.0 || !weight.is_finite() || weight <= 0.0 {
            return;
        }
        let x = shape.features();
        if x.iter().any(|v| !v.is_finite()) {
            return;
        }
        for i in 0..4 {
            for j in 0..4 {
                self.xtx[i][j] = self.decay * self.xtx[i][j] + weight * x[i] * x[j];
            }
            self.xty[i] = self.decay * self.xty[i] + weight * x[i] * ms;
        }
        self.passes += 1;
        self.prompt_tokens = self.decay * self.prompt_tokens + shape.other_tokens;
    }

    /// Prompt tokens in the passes the fit remembers (older ones weighing less): how much
    /// its price of a prompt token rests on.
    pub fn prompt_tokens_seen(&self) -> f64 {
        self.prompt_tokens
    }

    /// The non-negative least-squares coefficients: solve, drop the most negative
    /// coefficient (fixed at 0), solve again. A feature never observed gets 0.
    pub fn coefficients(&self) -> Coefficients {
        let mut free = [true; 4];
        // A feature no pass had (its column is all zeros) stays 0.
        for (i, f) in free.iter_mut().enumerate() {
            *f = self.xtx[i][i] > 0.0;
        }
        let mut beta = [0.0; 4];
        for _ in 0..4 {
            beta = self.solve(&free);
            let worst = (0..4)
                .filter(|&i| free[i] && beta[i] < 0.0)
                .min_by(|&a, &b| beta[a].total_cmp(&beta[b]));
            match worst {
                Some(i) => free[i] = false,
                None => break,
            }
        }
        let clean = |v: f64| if v.is_finite() { v.max(0.0) } else { 0.0 };
        Coefficients {
            base_ms: clean(beta[0]),
            per_row_ms: clean(beta[1]),
            per_token_ms: clean(beta[2]),
            per_mpair_ms: clean(beta[3]),
        }
    }

    /// The ridge-regularised normal equations over the `free` features (the others 0),
    /// by Gaussian elimination with partial pivoting.
    fn solve(&self, free: &[bool; 4]) -> [f64; 4] {
        let idx: Vec<usize> = (0..4).filter(|&i| free[i]).collect();
        let n = idx.len();
        let mut a = vec![vec![0.0; n + 1]; n];
        for (r, &i) in idx.iter().enumerate() {
            for (c, &j) in idx.iter().enumerate() {
                a[r][c] = self.xtx[i][j];
            }
            // A relative ridge keeps collinear features (decode rows that always come with
            // the same context) solvable without pulling a well-determined one off its value.
            a[r][r] += self.xtx[i][i] * 1e-9 + 1e-12;
            a[r][n] = self.xty[i];
        }
        for col in 0..n {
            let pivot = (col..n)
                .max_by(|&p, &q| a[p][col].abs().total_cmp(&a[q][col].abs()))
                .unwrap_or(col);
            a.swap(col, pivot);
            let d = a[col][col];
            if d.abs() < 1e-300 {
                continue;
            }
            let pivot_row = a[col].clone();
            for (row, r) in a.iter_mut().enumerate() {
                if row != col {
                    let f = r[col] / d;
                    for (x, p) in r[col..].iter_mut().zip(&pivot_row[col..]) {
                        *x -= f * p;
                    }
                }
            }
        }
        let mut beta = [0.0; 4];
        for (r, &i) in idx.iter().enumerate() {
            let d = a[r][r];
            beta[i] = if d.abs() < 1e-300 { 0.0 } else { a[r][n] / d };
        }
        beta
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRUE: Coefficients = Coefficients {
        base_ms: 2.0,
        per_row_ms: 0.5,
        per_token_ms: 0.3,
        per_mpair_ms: 40.0,
    };

    /// A deterministic spread of pass shapes: decode batches and prompt chunks, mixed.
    fn shapes() -> Vec<StepShape> {
        let mut out = Vec::new();
        for i in 0..200u64 {
            let rows = i % 9;
            let decode = StepShape::decode(rows, rows * (100 + 37 * (i % 13)));
            let shape = match i % 3 {
                0 => decode,
                1 => decode.plus(StepShape::chunk((i % 5) * 64, 16 * (1 + i % 16), false)),
                _ => StepShape::chunk(0, 32 + (i % 7) * 48, true),
            };
            if shape.sampled_rows + shape.other_tokens > 0.0 {
                out.push(shape);
            }
        }
        out
    }

    fn close(a: f64, b: f64, rel: f64) -> bool {
        (a - b).abs() <= rel * b.abs().max(1e-9)
    }

    #[test]
    fn recovers_the_coefficients_of_exact_passes() {
        let mut fit = CostFit::new(1.0);
        for s in shapes() {
            fit.observe(&s, TRUE.step_ms(&s));
        }
        let c = fit.coefficients();
        assert!(close(c.base_ms, 2.0, 1e-3), "{c:?}");
        assert!(close(c.per_row_ms, 0.5, 1e-3), "{c:?}");
        assert!(close(c.per_token_ms, 0.3, 1e-3), "{c:?}");
        assert!(close(c.per_mpair_ms, 40.0, 1e-3), "{c:?}");
    }

    #[test]
    fn light_calibration_passes_price_alone_and_give_way_to_real_ones() {
        // Calibration alone, at any weight: the coefficients of its passes.
        let mut fit = CostFit::default();
        for s in shapes() {
            fit.observe_weighted(&s, TRUE.step_ms(&s), 0.05);
        }
        let c = fit.coefficients();
        assert!(close(c.per_token_ms, 0.3, 1e-3), "{c:?}");
        assert!(
            fit.prompt_tokens_seen() > MIN_PROMPT_TOKENS_SEEN,
            "counted in full"
        );
        // Real passes of one shape that run four times slower (a worker sharing its cores):
        // a few of them and the fit prices that shape near what they measured, not the
        // calibration's level.
        let long = StepShape::chunk(0, 2048, true);
        for _ in 0..5 {
            fit.observe(&long, 4.0 * TRUE.step_ms(&long));
        }
        let c = fit.coefficients();
        let predicted = c.step_ms(&long);
        assert!(
            close(predicted, 4.0 * TRUE.step_ms(&long), 0.1),
            "{predicted} {c:?}"
        );
        // Nonsense weights are ignored.
        let before = fit.coefficients();
        fit.observe_weighted(&long, 1.0, f64::NAN);
        fit.observe_weighted(&long, 1.0, -1.0);
        assert_eq!(fit.coefficients(), before);
    }

    #[test]
    fn noisy_passes_predict_within_a_few_percent() {
        let mut fit = CostFit::default();
        // A fixed pseudo-random ±10 % noise.
        let mut state = 0x9e37_79b9_u64;
        for s in shapes().iter().cycle().take(2000) {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let noise = 1.0 + 0.2 * ((state >> 33) as f64 / (1u64 << 31) as f64 - 0.5);
            fit.observe(s, TRUE.step_ms(s) * noise);
        }
        let c = fit.coefficients();
        for s in shapes() {
            assert!(close(c.step_ms(&s), TRUE.step_ms(&s), 0.05), "{s:?}: {c:?}");
        }
    }

    #[test]
    fn an_unseen_feature_stays_zero_and_none_goes_negative() {
        // A decode worker that never ran a prompt chunk cannot price one.
        let mut fit = CostFit::default();
        for rows in 1..20u64 {
            let s = StepShape::decode(rows, rows * 300);
            fit.observe(&s, TRUE.step_ms(&s));
        }
        let c = fit.coefficients();
        assert_eq!(c.per_token_ms, 0.0);
        assert!(!c.knows_prompts());
        assert_eq!(fit.prompt_tokens_seen(), 0.0);
        fit.observe(&StepShape::chunk(0, 64, true), 30.0);
        assert_eq!(fit.prompt_tokens_seen(), 63.0);
        assert!(c.is_fitted());
        // Times that fall with the rows would fit a negative slope: held at 0 instead.
        let mut fit = CostFit::default();
        for rows in 1..20u64 {
            fit.observe(&StepShape::decode(rows, 0), 30.0 - rows as f64);
        }
        let c = fit.coefficients();
        assert!(c.per_row_ms >= 0.0 && c.base_ms > 0.0, "{c:?}");
        // Nonsense times are ignored.
        fit.observe(&StepShape::decode(1, 0), f64::NAN);
        fit.observe(&StepShape::decode(1, 0), -1.0);
        assert_eq!(fit.passes(), 19);
        assert_eq!(CostFit::default().coefficients(), Coefficients::default());
    }

    #[test]
    fn a_chunk_counts_its_attention_pairs_and_its_sampled_row() {
        let c = StepShape::chunk(100, 4, true);
        assert_eq!(c.sampled_rows, 1.0);
        assert_eq!(c.other_tokens, 3.0);
        // Rows attend to 101, 102, 103 and 104 keys.
        assert!(close(c.attention_mpairs, 410.0 / 1e6, 1e-12));
        assert_eq!(StepShape::chunk(0, 0, true), StepShape::default());
    }

    #[test]
    fn prompt_time_adds_up_its_chunks() {
        let beside = StepShape::decode(4, 4000);
        let (ms, passes) = TRUE.prompt_ms(beside, 0, 1000, 256);
        assert_eq!(passes, 4);
        let by_hand: f64 = [
            (0, 256, false),
            (256, 256, false),
            (512, 256, false),
            (768, 232, true),
        ]
        .iter()
        .map(|&(s, l, last)| TRUE.step_ms(&beside.plus(StepShape::chunk(s, l, last))))
        .sum();
        assert!(close(ms, by_hand, 1e-12));
        assert_eq!(TRUE.prompt_ms(beside, 10, 0, 256), (0.0, 0));
    }

    #[test]
    fn the_allowance_is_the_largest_chunk_within_the_target() {
        let beside = StepShape::decode(8, 8 * 1000);
        let target = 60.0;
        let l = TRUE.chunk_allowance(beside, 0, target, 2048, 16);
        assert_eq!(l % 16, 0);
        let at = |len| TRUE.step_ms(&beside.plus(StepShape::chunk(0, len, false)));
        assert!(at(l) <= target, "{l}");
        assert!(at(l + 16) > target, "{l}");
        // Capped by the pass's token limit; nothing when not a granule fits; the whole
        // limit when the fit cannot price prompt tokens.
        assert_eq!(TRUE.chunk_allowance(beside, 0, 1e9, 512, 16), 512);
        assert_eq!(TRUE.chunk_allowance(beside, 0, 1.0, 512, 16), 0);
        let blind = Coefficients {
            per_token_ms: 0.0,
            ..TRUE
        };
        assert_eq!(blind.chunk_allowance(beside, 0, 60.0, 512, 16), 512);
    }
}
