//! One serde configuration type for every algorithm, and the factory.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::{
    AlgoError, Dsa, DsaConfig, Full, FullConfig, Indexer, Oracle, OracleConfig, Quest, QuestConfig,
    RocketConfig, RocketKv, SnapKv, SnapKvConfig, SparseAlgorithm, StreamingConfig, StreamingLlm,
};

/// Which algorithm, with its settings. In TOML, `algorithm = "quest"` plus the fields of the
/// algorithm's config; missing fields take their defaults and unknown fields are rejected:
///
/// ```
/// use sparse_algo::AlgoConfig;
///
/// let c: AlgoConfig = toml::from_str("algorithm = \"quest\"\nbudget_tokens = 1024")?;
/// let AlgoConfig::Quest(q) = &c else { unreachable!() };
/// assert_eq!((q.page_size, q.budget_tokens), (16, 1024));
/// assert!(c.build(None).is_ok());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "algorithm", rename_all = "snake_case")]
pub enum AlgoConfig {
    /// [`Full`].
    Full(FullConfig),
    /// [`StreamingLlm`].
    StreamingLlm(StreamingConfig),
    /// [`Quest`].
    Quest(QuestConfig),
    /// [`SnapKv`].
    #[serde(rename = "snapkv")]
    SnapKv(SnapKvConfig),
    /// [`RocketKv`].
    #[serde(rename = "rocketkv")]
    RocketKv(RocketConfig),
    /// [`Dsa`].
    Dsa(DsaConfig),
    /// [`Oracle`].
    Oracle(OracleConfig),
}

impl AlgoConfig {
    /// Validates the settings and builds the algorithm. `indexer` is the model's trained DSA
    /// indexer; `None` gives DSA its generic fallback, and other algorithms ignore it.
    pub fn build(
        &self,
        indexer: Option<Arc<dyn Indexer>>,
    ) -> Result<Box<dyn SparseAlgorithm>, AlgoError> {
        Ok(match *self {
            AlgoConfig::Full(c) => Box::new(Full::new(c)?),
            AlgoConfig::StreamingLlm(c) => Box::new(StreamingLlm::new(c)?),
            AlgoConfig::Quest(c) => Box::new(Quest::new(c)?),
            AlgoConfig::SnapKv(c) => Box::new(SnapKv::new(c)?),
            AlgoConfig::RocketKv(c) => Box::new(RocketKv::new(c)?),
            AlgoConfig::Dsa(c) => Box::new(Dsa::new(c, indexer)?),
            AlgoConfig::Oracle(c) => Box::new(Oracle::new(c)?),
        })
    }

    /// Sets the decode budget in tokens where the algorithm has one (Quest, RocketKV's `topk`,
    /// DSA's `topk`, the oracle, StreamingLLM's window minus its sinks, SnapKV's capacity), for
    /// sweeps over budgets.
    pub fn with_budget(mut self, tokens: usize) -> Self {
        match &mut self {
            AlgoConfig::Full(_) => {}
            AlgoConfig::StreamingLlm(c) => {
                c.window_tokens = (tokens as u32).saturating_sub(c.sink_tokens).max(1);
            }
            AlgoConfig::Quest(c) => c.budget_tokens = tokens,
            AlgoConfig::SnapKv(c) => c.capacity = tokens,
            AlgoConfig::RocketKv(c) => c.topk = tokens,
            AlgoConfig::Dsa(c) => c.topk = tokens,
            AlgoConfig::Oracle(c) => c.budget_tokens = tokens,
        }
        self
    }
}
