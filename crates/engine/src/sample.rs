//! Sampling: greedy, temperature and top-p, from a seeded generator.

use serde::{Deserialize, Serialize};

use crate::{EngineError, RequestError};

/// How the next token is picked, and when generation stops.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Sampling {
    /// 0: greedy (arg-max); otherwise logits are divided by it before the softmax.
    pub temperature: f32,
    /// Nucleus sampling: only the most likely tokens whose probabilities sum to `top_p` are
    /// kept (1: all).
    pub top_p: f32,
    /// Seed of the generator (same seed, same prompt, same config: same tokens).
    pub seed: u64,
    /// Tokens generated at most.
    pub max_tokens: usize,
    /// Generation stops after any of these strings appears in the output (which keeps it).
    pub stop: Vec<String>,
    /// Stop at the model's end-of-sequence token.
    pub stop_at_eos: bool,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
            max_tokens: 128,
            stop: Vec::new(),
            stop_at_eos: true,
        }
    }
}

impl Sampling {
    /// Rejects values that cannot sample.
    pub fn validate(&self) -> Result<(), RequestError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(RequestError::Sampling(format!(
                "temperature {} (must be finite and ≥ 0)",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(RequestError::Sampling(format!(
                "top_p {} (must be in (0, 1])",
                self.top_p
            )));
        }
        if self.max_tokens == 0 {
            return Err(RequestError::Sampling("max_tokens 0".into()));
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(RequestError::Sampling("an empty stop string".into()));
        }
        Ok(())
    }
}

/// A validated sampler with its generator state.
#[derive(Clone, Debug)]
pub struct Sampler {
    config: Sampling,
    state: u64,
}

impl Sampler {
    /// A sampler for `config`.
    pub fn new(config: &Sampling) -> Result<Sampler, EngineError> {
        config.validate()?;
        Ok(Sampler {
            config: config.clone(),
            state: config.seed ^ 0x853c_49e6_748f_ea9b,
        })
    }

    /// The next token given its logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.config.temperature == 0.0 {
            return crate::eval::argmax(logits);
        }
        let t = self.config.temperature;
        let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut p: Vec<(f32, u32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &x)| (((x - m) / t).exp(), i as u32))
            .collect();
        p.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let total: f32 = p.iter().map(|x| x.0).sum();
        let mut keep = p.len();
        if self.config.top_p < 1.0 {
            let mut acc = 0.0;
            for (i, x) in p.iter().enumerate() {
                acc += x.0 / total;
                if acc >= self.config.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        let kept: f32 = p[..keep].iter().map(|x| x.0).sum();
        let mut r = self.uniform() * kept;
        for &(w, id) in &p[..keep] {
            if r < w {
                return id;
            }
            r -= w;
        }
        p[keep - 1].1
    }

    /// A uniform value in [0, 1).
    fn uniform(&mut self) -> f32 {
        unit(&mut self.state)
    }
}

/// The next value of a splitmix64 generator, as a uniform f32 in [0, 1).
pub(crate) fn unit(state: &mut u64) -> f32 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    (z >> 40) as f32 / (1u64 << 24) as f32
}
