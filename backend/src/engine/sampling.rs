//! Token sampling: per-request sampling settings (`SamplingParams`, as the
//! OpenAI API gives them) and the `Sampler` that turns one position's logits
//! into a token, with penalties, temperature, top-k, top-p, a seeded RNG and
//! the raw distribution's logprobs.

use std::collections::HashMap;
use std::fmt;

/// Per-request sampling settings, as the OpenAI API gives them. Fields left
/// out of a request take their defaults.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 = greedy; default 1.0.
    pub temperature: f32,
    /// Nucleus mass, in (0, 1]; default 1.0 (off).
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; 0 = off; default 0.
    pub top_k: u32,
    /// Reproducible sampling when set.
    pub seed: Option<u64>,
    /// -2..=2, default 0.
    pub presence_penalty: f32,
    /// -2..=2, default 0.
    pub frequency_penalty: f32,
    /// Return the chosen token's logprob.
    pub logprobs: bool,
    /// 0..=20 alternatives per position.
    pub top_logprobs: u32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logprobs: false,
            top_logprobs: 0,
        }
    }
}

/// Most alternatives `top_logprobs` may ask for (the OpenAI limit).
pub const MAX_TOP_LOGPROBS: u32 = 20;

impl SamplingParams {
    /// Checks ranges (temperature 0..=2 and finite, top_p in (0,1], penalties
    /// in -2..=2, top_logprobs <= 20); Err(message) names the field and the
    /// allowed range. NaN fails every range.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=2.0).contains(&self.temperature) {
            return Err(format!(
                "temperature must be between 0 and 2, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!(
                "top_p must be greater than 0 and at most 1, got {}",
                self.top_p
            ));
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return Err(format!(
                "presence_penalty must be between -2 and 2, got {}",
                self.presence_penalty
            ));
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err(format!(
                "frequency_penalty must be between -2 and 2, got {}",
                self.frequency_penalty
            ));
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(format!(
                "top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {}",
                self.top_logprobs
            ));
        }
        Ok(())
    }

    fn wants_logprobs(&self) -> bool {
        self.logprobs || self.top_logprobs > 0
    }
}

/// One sampled token.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// log-probability of `token` under the model's raw distribution
    /// (log-softmax of the logits before penalties/temperature); filled only
    /// when params.logprobs or top_logprobs > 0, else 0.0.
    pub logprob: f32,
    /// the `top_logprobs` most likely tokens under the same raw distribution,
    /// most likely first, (token, logprob); empty unless asked.
    pub top: Vec<(u32, f32)>,
}

/// Samples tokens for one request; keeps the request's RNG and token counts.
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// How often each generated (sampled or observed) token occurred.
    counts: HashMap<u32, u32>,
    /// Scratch: packed sort keys (see `sort_key`) for top-k / top-p /
    /// top_logprobs selection.
    keys: Vec<u64>,
    /// Scratch: the raw logits, kept while logprobs are asked for.
    raw: Vec<f32>,
}

impl fmt::Debug for Sampler {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sampler")
            .field("params", &self.params)
            .field("distinct_tokens", &self.counts.len())
            .finish_non_exhaustive()
    }
}

impl Sampler {
    /// `fallback_seed` is used when params.seed is None (the engine passes a
    /// per-request random-ish number).
    pub fn new(params: SamplingParams, fallback_seed: u64) -> Sampler {
        let rng = Rng::new(params.seed.unwrap_or(fallback_seed));
        Sampler {
            params,
            rng,
            counts: HashMap::new(),
            keys: Vec::new(),
            raw: Vec::new(),
        }
    }

    /// The settings this sampler was made with.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits` (one per vocabulary entry; may be
    /// modified in place). Applies, in order: frequency/presence penalties from
    /// the tokens seen so far (OpenAI formula:
    /// `logit -= count*frequency_penalty + (count>0)*presence_penalty`), then
    /// greedy argmax when temperature == 0 (ties -> lowest id), else
    /// temperature scaling, top-k, top-p (nucleus: smallest set of most likely
    /// tokens whose probability mass >= top_p), and a draw from the RNG.
    /// Records the chosen token for later penalties.
    ///
    /// "Most likely" orders by logit, ties by lowest id. NaN logits count as
    /// -inf. Panics when `logits` is empty or longer than `u32::MAX` entries.
    pub fn sample(&mut self, logits: &mut [f32]) -> Sampled {
        assert!(!logits.is_empty(), "sample: empty logits");
        assert!(
            u32::try_from(logits.len()).is_ok(),
            "sample: vocabulary too large"
        );

        // Logprobs are of the raw distribution: take them before penalties.
        let want_lp = self.params.wants_logprobs();
        let mut lse = 0.0f64;
        let mut top = Vec::new();
        if want_lp {
            lse = log_sum_exp(logits);
            let n_top = (self.params.top_logprobs as usize).min(logits.len());
            if n_top > 0 {
                fill_keys(&mut self.keys, logits);
                extend_sorted(&mut self.keys, 0, n_top);
                top = self.keys[..n_top]
                    .iter()
                    .map(|&k| {
                        let t = key_id(k);
                        (t, logprob(logits[t as usize], lse))
                    })
                    .collect();
            }
            self.raw.clear();
            self.raw.extend_from_slice(logits);
        }

        self.apply_penalties(logits);
        let token = if self.params.temperature == 0.0 {
            argmax(logits)
        } else {
            self.draw(logits)
        };
        self.observe(token);

        let logprob = if want_lp {
            logprob(self.raw[token as usize], lse)
        } else {
            0.0
        };
        Sampled {
            token,
            logprob,
            top,
        }
    }

    /// Records a token that was not sampled here (e.g. prompt tokens are NOT
    /// recorded; this is for tokens forced by the engine) for the penalties.
    pub fn observe(&mut self, token: u32) {
        *self.counts.entry(token).or_insert(0) += 1;
    }

    fn apply_penalties(&self, logits: &mut [f32]) {
        let (freq, pres) = (self.params.frequency_penalty, self.params.presence_penalty);
        if freq == 0.0 && pres == 0.0 {
            return;
        }
        for (&token, &count) in &self.counts {
            if let Some(l) = logits.get_mut(token as usize) {
                // Every entry has count >= 1, so the presence term always applies.
                *l -= count as f32 * freq + pres;
            }
        }
    }

    /// Temperature, top-k, top-p and the draw, for temperature > 0. Turns the
    /// candidates' entries of `logits` into unnormalised probabilities.
    fn draw(&mut self, logits: &mut [f32]) -> u32 {
        let n = logits.len();
        let inv_t = 1.0 / self.params.temperature;
        let k = self.params.top_k as usize;
        let use_k = k > 0 && k < n;
        let use_p = self.params.top_p < 1.0;

        let max = max_key(logits);
        if max.is_infinite() {
            // All -inf (nothing to weigh), or +inf (it outweighs everything).
            return argmax(logits);
        }

        if !use_k && !use_p {
            // Whole vocabulary, in id order: no keys, no sorting.
            let total = to_weights(logits, max, inv_t);
            let u = self.rng.next_f64() * total;
            return pick(logits.iter().enumerate().map(|(t, &w)| (t as u32, w)), u);
        }

        fill_keys(&mut self.keys, logits);
        let (cands, total) = if use_k {
            // The k most likely, most likely first; weights on those only.
            extend_sorted(&mut self.keys, 0, k);
            let mut total = 0.0f64;
            for &key in &self.keys[..k] {
                let l = &mut logits[key_id(key) as usize];
                *l = weight(*l, max, inv_t);
                total += f64::from(*l);
            }
            (k, total)
        } else {
            (n, to_weights(logits, max, inv_t))
        };

        let (cands, mass) = if use_p {
            let target = f64::from(self.params.top_p) * total;
            let sorted = if use_k { k } else { 0 };
            nucleus(&mut self.keys[..cands], sorted, logits, target)
        } else {
            (cands, total)
        };

        let u = self.rng.next_f64() * mass;
        pick(
            self.keys[..cands].iter().map(|&key| {
                let t = key_id(key);
                (t, logits[t as usize])
            }),
            u,
        )
    }
}

/// A logit as an order key: NaN counts as -inf, -0.0 as 0.0.
fn key(l: f32) -> f32 {
    if l.is_nan() {
        f32::NEG_INFINITY
    } else {
        l + 0.0
    }
}

/// Token `id` with logit `l`, packed so that ascending u64 order is "most
/// likely first, then lowest id": the high half is the logit's bits turned
/// into an unsigned order and inverted, the low half is the id. Plain integer
/// compares make selection and sorting cheap.
fn sort_key(l: f32, id: u32) -> u64 {
    let bits = key(l).to_bits();
    let ascending = if bits >> 31 == 1 {
        !bits
    } else {
        bits | 1 << 31
    };
    (u64::from(!ascending) << 32) | u64::from(id)
}

fn key_id(key: u64) -> u32 {
    key as u32
}

fn fill_keys(keys: &mut Vec<u64>, logits: &[f32]) {
    keys.clear();
    keys.extend(
        logits
            .iter()
            .enumerate()
            .map(|(i, &l)| sort_key(l, i as u32)),
    );
}

fn max_key(logits: &[f32]) -> f32 {
    logits.iter().fold(f32::NEG_INFINITY, |m, &l| m.max(key(l)))
}

/// Highest logit, lowest id on ties; NaN counts as -inf.
fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_key = key(logits[0]);
    for (i, &l) in logits.iter().enumerate().skip(1) {
        let k = key(l);
        if k > best_key {
            best = i;
            best_key = k;
        }
    }
    best as u32
}

/// Unnormalised probability of `logit` at temperature 1/inv_t, relative to the
/// (finite) maximum `max`: 1 at the maximum, even when inv_t is infinite.
fn weight(logit: f32, max: f32, inv_t: f32) -> f32 {
    let d = key(logit) - max;
    if d == 0.0 { 1.0 } else { (d * inv_t).exp() }
}

/// Replaces every logit with its weight; returns the sum (in f64).
fn to_weights(logits: &mut [f32], max: f32, inv_t: f32) -> f64 {
    let mut total = 0.0f64;
    for l in logits.iter_mut() {
        *l = weight(*l, max, inv_t);
        total += f64::from(*l);
    }
    total
}

/// ln(sum(exp(logits))), summed in f64; NaN logits count as -inf.
fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = max_key(logits);
    if max.is_infinite() {
        return f64::from(max);
    }
    let sum: f64 = logits.iter().map(|&l| f64::from(weight(l, max, 1.0))).sum();
    f64::from(max) + sum.ln()
}

/// log-softmax of one raw logit given the log-sum-exp; -inf where undefined.
fn logprob(raw: f32, lse: f64) -> f32 {
    let lp = (f64::from(key(raw)) - lse) as f32;
    if lp.is_nan() { f32::NEG_INFINITY } else { lp }
}

/// Given `keys[..sorted]` sorted and not after anything in `keys[sorted..]`,
/// makes `keys[..upto]` the same (upto clamped to the length). Costs O(len)
/// plus sorting the new part, never a sort of the whole slice unless `upto`
/// reaches the end.
fn extend_sorted(keys: &mut [u64], sorted: usize, upto: usize) {
    let upto = upto.min(keys.len());
    if upto <= sorted {
        return;
    }
    let rest = &mut keys[sorted..];
    let want = upto - sorted;
    if want < rest.len() {
        rest.select_nth_unstable(want - 1);
    }
    rest[..want].sort_unstable();
}

/// First candidates in a block when growing the nucleus; grows 4x per round.
const NUCLEUS_FIRST: usize = 64;

/// The nucleus of `keys` (candidates whose entries in `weights` are
/// unnormalised probabilities; `keys[..sorted]` already sorted): reorders
/// `keys` so that its first `len` entries are the smallest set of most likely
/// candidates whose weight sum reaches `target`, and returns (len, that sum).
/// Selects in growing blocks, so a small nucleus costs a few linear passes,
/// not a full sort.
fn nucleus(keys: &mut [u64], mut sorted: usize, weights: &[f32], target: f64) -> (usize, f64) {
    let n = keys.len();
    let mut cum = 0.0f64;
    let mut seen = 0usize;
    let mut upto = NUCLEUS_FIRST.max(sorted).min(n);
    loop {
        extend_sorted(keys, sorted, upto);
        sorted = upto;
        for (j, &key) in keys[seen..sorted].iter().enumerate() {
            cum += f64::from(weights[key_id(key) as usize]);
            if cum >= target {
                return (seen + j + 1, cum);
            }
        }
        seen = sorted;
        if sorted == n {
            // Rounding kept the sum short of the target: keep everything.
            return (n, cum);
        }
        upto = (sorted * 4).min(n);
    }
}

/// The first candidate at which the running weight sum passes `u`; the last
/// candidate of positive weight if rounding lets `u` run past the end.
fn pick(cands: impl Iterator<Item = (u32, f32)>, u: f64) -> u32 {
    let mut cum = 0.0f64;
    let mut last = None;
    let mut first = None;
    for (t, w) in cands {
        first.get_or_insert(t);
        if w > 0.0 {
            cum += f64::from(w);
            if cum > u {
                return t;
            }
            last = Some(t);
        }
    }
    last.or(first).unwrap_or(0)
}

/// xoshiro256** seeded through splitmix64: small, fast, reproducible.
#[derive(Clone, Debug)]
struct Rng {
    s: [u64; 4],
}

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut x = seed;
        let mut splitmix = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        // splitmix64 never yields four zero words in a row, so the state is valid.
        Rng {
            s: [splitmix(), splitmix(), splitmix(), splitmix()],
        }
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1), 53 bits.
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SamplingParams {
        SamplingParams::default()
    }

    fn greedy() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            ..params()
        }
    }

    /// Draws `n` tokens from fresh copies of `logits`.
    fn draws(sampler: &mut Sampler, logits: &[f32], n: usize) -> Vec<u32> {
        (0..n)
            .map(|_| sampler.sample(&mut logits.to_vec()).token)
            .collect()
    }

    fn frequencies(tokens: &[u32], vocab: usize) -> Vec<f64> {
        let mut f = vec![0.0; vocab];
        for &t in tokens {
            f[t as usize] += 1.0;
        }
        f.iter().map(|c| c / tokens.len() as f64).collect()
    }

    /// Deterministic pseudo-random logits in [-8, 8).
    fn random_logits(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        (0..n)
            .map(|_| (rng.next_f64() * 16.0 - 8.0) as f32)
            .collect()
    }

    fn log_softmax(logits: &[f32]) -> Vec<f64> {
        let max = logits
            .iter()
            .fold(f64::NEG_INFINITY, |m, &l| m.max(l as f64));
        let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
        logits.iter().map(|&l| l as f64 - max - sum.ln()).collect()
    }

    const LN3: [f32; 3] = [-std::f32::consts::LN_2, -1.203_972_8, -1.609_438]; // ln .5, .3, .2

    #[test]
    fn defaults_match_openai() {
        let p = params();
        assert_eq!(p.temperature, 1.0);
        assert_eq!(p.top_p, 1.0);
        assert_eq!(p.top_k, 0);
        assert_eq!(p.seed, None);
        assert_eq!(p.presence_penalty, 0.0);
        assert_eq!(p.frequency_penalty, 0.0);
        assert!(!p.logprobs);
        assert_eq!(p.top_logprobs, 0);
        assert_eq!(p.validate(), Ok(()));
    }

    #[test]
    fn validate_rejects_out_of_range() {
        let bad = |p: SamplingParams, field: &str| {
            let err = p.validate().expect_err(field);
            assert!(err.contains(field), "{err:?} should name {field}");
        };
        bad(
            SamplingParams {
                temperature: 3.0,
                ..params()
            },
            "temperature",
        );
        bad(
            SamplingParams {
                temperature: -0.1,
                ..params()
            },
            "temperature",
        );
        bad(
            SamplingParams {
                temperature: f32::NAN,
                ..params()
            },
            "temperature",
        );
        bad(
            SamplingParams {
                top_p: 0.0,
                ..params()
            },
            "top_p",
        );
        bad(
            SamplingParams {
                top_p: 1.5,
                ..params()
            },
            "top_p",
        );
        bad(
            SamplingParams {
                top_p: f32::NAN,
                ..params()
            },
            "top_p",
        );
        bad(
            SamplingParams {
                presence_penalty: 2.5,
                ..params()
            },
            "presence_penalty",
        );
        bad(
            SamplingParams {
                frequency_penalty: -3.0,
                ..params()
            },
            "frequency_penalty",
        );
        bad(
            SamplingParams {
                top_logprobs: 21,
                ..params()
            },
            "top_logprobs",
        );
        let edges = SamplingParams {
            temperature: 2.0,
            top_p: 1.0,
            presence_penalty: -2.0,
            frequency_penalty: 2.0,
            top_logprobs: 20,
            ..params()
        };
        assert_eq!(edges.validate(), Ok(()));
        assert_eq!(greedy().validate(), Ok(()));
    }

    #[test]
    fn greedy_picks_argmax_and_lowest_id_on_ties() {
        let mut s = Sampler::new(greedy(), 1);
        assert_eq!(s.sample(&mut [0.1, 3.0, -1.0, 2.9]).token, 1);
        assert_eq!(s.sample(&mut [1.0, 5.0, 2.0, 5.0, 5.0]).token, 1);
        assert_eq!(s.sample(&mut [7.0, 7.0]).token, 0);
        assert_eq!(s.sample(&mut [-0.0, 0.0]).token, 0);
        assert_eq!(s.sample(&mut [f32::NAN, -1.0]).token, 1);
        assert_eq!(s.sample(&mut [f32::NEG_INFINITY; 4]).token, 0);
    }

    #[test]
    fn greedy_ignores_seed() {
        let logits = random_logits(1000, 9);
        let a = draws(&mut Sampler::new(greedy(), 1), &logits, 20);
        let b = draws(&mut Sampler::new(greedy(), 2), &logits, 20);
        assert_eq!(a, b);
        assert!(a.iter().all(|&t| t == argmax(&logits)));
    }

    #[test]
    fn same_seed_same_sequence() {
        let logits = random_logits(5000, 3);
        for p in [
            params(),
            SamplingParams {
                top_k: 40,
                ..params()
            },
            SamplingParams {
                top_p: 0.9,
                ..params()
            },
            SamplingParams {
                top_k: 50,
                top_p: 0.8,
                temperature: 0.7,
                ..params()
            },
        ] {
            let p = SamplingParams {
                seed: Some(42),
                ..p
            };
            let a = draws(&mut Sampler::new(p.clone(), 1), &logits, 200);
            let b = draws(&mut Sampler::new(p, 2), &logits, 200);
            assert_eq!(a, b);
        }
    }

    #[test]
    fn fallback_seed_used_when_seed_is_none() {
        let logits = random_logits(500, 4);
        let a = draws(&mut Sampler::new(params(), 77), &logits, 100);
        let b = draws(
            &mut Sampler::new(
                SamplingParams {
                    seed: Some(77),
                    ..params()
                },
                0,
            ),
            &logits,
            100,
        );
        let c = draws(&mut Sampler::new(params(), 78), &logits, 100);
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn different_seeds_different_sequences() {
        let logits = vec![0.0f32; 100];
        let p = |seed| SamplingParams {
            seed: Some(seed),
            ..params()
        };
        let a = draws(&mut Sampler::new(p(1), 0), &logits, 200);
        let b = draws(&mut Sampler::new(p(2), 0), &logits, 200);
        assert_ne!(a, b);
        let same = a.iter().zip(&b).filter(|(x, y)| x == y).count();
        assert!(same < 20, "{same} of 200 draws agree");
        // And one sampler does not repeat itself on a flat distribution.
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert!(distinct.len() > 50, "{} distinct", distinct.len());
    }

    #[test]
    fn near_zero_temperature_is_greedy() {
        let mut logits = random_logits(49_152, 5);
        let best = argmax(&logits);
        // A clear margin: 0.01 / 1e-4 = 100 nats over the runner-up.
        logits[best as usize] += 0.01;
        let p = SamplingParams {
            temperature: 1e-4,
            ..params()
        };
        let mut s = Sampler::new(p, 11);
        assert!(draws(&mut s, &logits, 50).iter().all(|&t| t == best));
    }

    #[test]
    fn top_k_one_is_greedy() {
        let logits = random_logits(49_152, 6);
        let best = argmax(&logits);
        let p = SamplingParams {
            top_k: 1,
            temperature: 2.0,
            ..params()
        };
        let mut s = Sampler::new(p, 12);
        assert!(draws(&mut s, &logits, 50).iter().all(|&t| t == best));
    }

    #[test]
    fn top_k_keeps_only_the_k_most_likely() {
        let logits: Vec<f32> = (0..100).map(|i| (i % 10) as f32 * 0.1).collect();
        // The three largest are 0.9 at ids 9, 19, 29 (ties broken by lowest id).
        let p = SamplingParams {
            top_k: 3,
            ..params()
        };
        let mut s = Sampler::new(p, 13);
        let tokens = draws(&mut s, &logits, 3000);
        assert!(tokens.iter().all(|t| [9, 19, 29].contains(t)));
        let f = frequencies(&tokens, 100);
        for t in [9, 19, 29] {
            assert!((f[t] - 1.0 / 3.0).abs() < 0.04, "{f:?}");
        }
    }

    #[test]
    fn small_top_p_keeps_only_the_most_likely() {
        let logits = random_logits(49_152, 7);
        let best = argmax(&logits);
        let p = SamplingParams {
            top_p: 1e-6,
            ..params()
        };
        let mut s = Sampler::new(p, 14);
        assert!(draws(&mut s, &logits, 50).iter().all(|&t| t == best));
    }

    #[test]
    fn top_p_renormalises_over_the_nucleus() {
        // 0.5 < 0.75 <= 0.5 + 0.3: the nucleus is {0, 1}, drawn 5:3.
        let p = SamplingParams {
            top_p: 0.75,
            ..params()
        };
        let mut s = Sampler::new(p, 15);
        let tokens = draws(&mut s, &LN3, 20_000);
        let f = frequencies(&tokens, 3);
        assert_eq!(f[2], 0.0);
        assert!((f[0] - 0.625).abs() < 0.02, "{f:?}");
        assert!((f[1] - 0.375).abs() < 0.02, "{f:?}");
    }

    #[test]
    fn nucleus_matches_a_full_sort() {
        for (seed, top_p) in [(1, 0.5), (2, 0.9), (3, 0.99), (4, 0.01), (5, 1.0)] {
            // Temperature 4 flattens the distribution so the nucleus needs
            // several growth rounds.
            let logits = random_logits(20_000, seed);
            let w: Vec<f32> = logits.iter().map(|&l| weight(l, 8.0, 0.25)).collect();
            let total: f64 = w.iter().map(|&x| x as f64).sum();
            let target = top_p * total;
            let mut keys = Vec::new();
            fill_keys(&mut keys, &logits);
            let (len, mass) = nucleus(&mut keys, 0, &w, target);

            let mut all: Vec<u32> = (0..w.len() as u32).collect();
            all.sort_by(|&a, &b| {
                logits[b as usize]
                    .total_cmp(&logits[a as usize])
                    .then(a.cmp(&b))
            });
            let mut cum = 0.0;
            let want = all
                .iter()
                .position(|&t| {
                    cum += w[t as usize] as f64;
                    cum >= target
                })
                .map_or(all.len(), |p| p + 1);
            assert_eq!(len, want, "seed {seed} top_p {top_p}");
            let got: Vec<u32> = keys[..len].iter().map(|&k| key_id(k)).collect();
            assert_eq!(got, &all[..len]);
            assert!(mass >= target || len == all.len());
        }
    }

    #[test]
    fn sort_keys_order_by_logit_then_id() {
        let values = [
            f32::NEG_INFINITY,
            -1e30,
            -1.0,
            -f32::MIN_POSITIVE,
            -0.0,
            0.0,
            1e-40,
            0.5,
            3.0,
            f32::INFINITY,
        ];
        for (i, &a) in values.iter().enumerate() {
            for (j, &b) in values.iter().enumerate() {
                for (ia, ib) in [(0u32, 1u32), (1, 0), (5, 5)] {
                    let want = key(b).partial_cmp(&key(a)).unwrap().then(ia.cmp(&ib));
                    let got = sort_key(a, ia).cmp(&sort_key(b, ib));
                    assert_eq!(got, want, "{i} {j} ({a}, {ia}) vs ({b}, {ib})");
                }
            }
        }
        assert_eq!(sort_key(f32::NAN, 3), sort_key(f32::NEG_INFINITY, 3));
        assert_eq!(key_id(sort_key(-2.5, 49_151)), 49_151);
    }

    #[test]
    fn sampled_frequencies_match_softmax() {
        let mut s = Sampler::new(
            SamplingParams {
                seed: Some(2024),
                ..params()
            },
            0,
        );
        let f = frequencies(&draws(&mut s, &LN3, 20_000), 3);
        for (got, want) in f.iter().zip([0.5, 0.3, 0.2]) {
            assert!((got - want).abs() < 0.02, "{f:?}");
        }
    }

    #[test]
    fn temperature_sharpens_the_distribution() {
        // At T = 0.5 the probabilities square: .25 : .09 : .04.
        let p = SamplingParams {
            temperature: 0.5,
            seed: Some(5),
            ..params()
        };
        let mut s = Sampler::new(p, 0);
        let f = frequencies(&draws(&mut s, &LN3, 20_000), 3);
        for (got, want) in f.iter().zip([0.25 / 0.38, 0.09 / 0.38, 0.04 / 0.38]) {
            assert!((got - want).abs() < 0.02, "{f:?}");
        }
    }

    #[test]
    fn frequency_penalty_changes_the_pick_after_repeats() {
        let p = SamplingParams {
            frequency_penalty: 0.3,
            ..greedy()
        };
        let mut s = Sampler::new(p, 0);
        let logits = [1.0f32, 0.5, 0.0];
        // 1.0 beats 0.5; after one 0: 0.7 > 0.5; after two: 0.4 < 0.5.
        let picks = draws(&mut s, &logits, 3);
        assert_eq!(picks, [0, 0, 1]);
        // Without the penalty greedy never moves.
        assert_eq!(draws(&mut Sampler::new(greedy(), 0), &logits, 3), [0, 0, 0]);
    }

    #[test]
    fn presence_penalty_applies_once_per_token() {
        let p = SamplingParams {
            presence_penalty: 0.6,
            ..greedy()
        };
        let mut s = Sampler::new(p, 0);
        let logits = [1.0f32, 0.5, 0.2];
        // 0, then 0.4 < 0.5 picks 1, then 0 and 1 are both penalised once:
        // 0.4 vs -0.1 vs 0.2 picks 0 again; a second count does not add more.
        assert_eq!(draws(&mut s, &logits, 4), [0, 1, 0, 0]);
    }

    #[test]
    fn penalties_follow_the_openai_formula() {
        let p = SamplingParams {
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..greedy()
        };
        let mut s = Sampler::new(p, 0);
        s.observe(1);
        s.observe(1);
        s.observe(1);
        s.observe(7); // out of this vocabulary: ignored
        let mut logits = [0.0f32, 2.0, 0.0];
        s.sample(&mut logits);
        assert_eq!(logits[1], 2.0 - (3.0 * 0.5 + 0.25));
        assert_eq!(logits[0], 0.0);
    }

    #[test]
    fn observed_tokens_count_for_penalties() {
        let p = SamplingParams {
            presence_penalty: 1.0,
            ..greedy()
        };
        let mut s = Sampler::new(p, 0);
        s.observe(0);
        assert_eq!(s.sample(&mut [1.0, 0.5]).token, 1);
    }

    #[test]
    fn logprobs_are_log_softmax_of_raw_logits() {
        let logits = random_logits(1000, 8);
        let want = log_softmax(&logits);
        let p = SamplingParams {
            temperature: 0.7,
            top_k: 50,
            top_p: 0.9,
            frequency_penalty: 1.0,
            presence_penalty: 1.0,
            logprobs: true,
            top_logprobs: 5,
            ..params()
        };
        let mut s = Sampler::new(p, 21);
        for _ in 0..20 {
            let out = s.sample(&mut logits.clone());
            let lp = want[out.token as usize];
            assert!(
                (out.logprob as f64 - lp).abs() < 1e-5,
                "{} vs {lp}",
                out.logprob
            );
            assert_eq!(out.top.len(), 5);
            let mut order: Vec<u32> = (0..1000).collect();
            order.sort_by(|&a, &b| want[b as usize].total_cmp(&want[a as usize]));
            for (&(t, l), &w) in out.top.iter().zip(&order) {
                assert_eq!(t, w);
                assert!((l as f64 - want[t as usize]).abs() < 1e-5);
            }
            assert!(out.top.windows(2).all(|w| w[0].1 >= w[1].1));
        }
    }

    #[test]
    fn logprob_alone_has_no_top_list() {
        let p = SamplingParams {
            logprobs: true,
            ..greedy()
        };
        let out = Sampler::new(p, 0).sample(&mut LN3.to_vec());
        assert_eq!(out.token, 0);
        assert!((out.logprob - 0.5f32.ln()).abs() < 1e-6);
        assert!(out.top.is_empty());
    }

    #[test]
    fn top_logprobs_are_capped_by_the_vocabulary() {
        let p = SamplingParams {
            top_logprobs: 20,
            ..params()
        };
        let out = Sampler::new(p, 0).sample(&mut LN3.to_vec());
        let tokens: Vec<u32> = out.top.iter().map(|&(t, _)| t).collect();
        assert_eq!(tokens, [0, 1, 2]);
        assert!(out.logprob < 0.0);
    }

    #[test]
    fn no_logprobs_unless_asked() {
        let out = Sampler::new(params(), 0).sample(&mut LN3.to_vec());
        assert_eq!(out.logprob, 0.0);
        assert!(out.top.is_empty());
    }

    #[test]
    fn degenerate_logits_do_not_panic() {
        let p = SamplingParams {
            logprobs: true,
            top_logprobs: 2,
            ..params()
        };
        let mut s = Sampler::new(p.clone(), 0);
        let out = s.sample(&mut [f32::NEG_INFINITY; 3]);
        assert!(out.token < 3);
        assert_eq!(s.sample(&mut [0.0, f32::INFINITY, 1.0]).token, 1);
        assert_eq!(s.sample(&mut [f32::NAN, 0.0, f32::NAN]).token, 1);
        let one = s.sample(&mut [f32::NEG_INFINITY, 3.0, f32::NEG_INFINITY]);
        assert_eq!(one.token, 1);
        assert_eq!(one.logprob, 0.0);
        let mut k = Sampler::new(
            SamplingParams {
                top_k: 2,
                top_p: 0.5,
                ..p
            },
            0,
        );
        assert!(k.sample(&mut [f32::NEG_INFINITY; 3]).token < 3);
    }
}
