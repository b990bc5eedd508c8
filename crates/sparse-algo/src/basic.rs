//! The two algorithms without scores: Full (the dense baseline) and StreamingLLM.

use serde::{Deserialize, Serialize};

use crate::select::Plan;
use crate::{AlgoError, AlwaysInclude, Caps, Decode, RepPool, SparseAlgorithm, TopK};

/// Selects every page: dense attention through the sparse path, the baseline of every
/// comparison.
#[derive(Clone, Debug)]
pub struct Full {
    config: FullConfig,
}

/// Settings of [`Full`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FullConfig {
    /// Tokens per selected id.
    pub page_size: usize,
}

impl Default for FullConfig {
    fn default() -> Self {
        FullConfig { page_size: 16 }
    }
}

impl Full {
    /// Validates the configuration.
    pub fn new(config: FullConfig) -> Result<Self, AlgoError> {
        if config.page_size == 0 {
            return Err(AlgoError::Config("page size 0".to_owned()));
        }
        Ok(Full { config })
    }
}

impl SparseAlgorithm for Full {
    fn caps(&self) -> Caps {
        Caps {
            name: "full",
            page_size: self.config.page_size,
            decode: true,
            prefill_keep: false,
            reads_keys: false,
        }
    }

    fn retrieve_topk(&self, step: &Decode<'_>, _pool: &RepPool) -> Result<TopK, AlgoError> {
        step.validate()?;
        let ps = self.config.page_size;
        let rows: Vec<Vec<i32>> = (0..step.num_seqs() * step.kv_heads)
            .map(|r| (0..step.seq_lens[r / step.kv_heads].div_ceil(ps) as i32).collect())
            .collect();
        Ok(TopK::from_rows(&rows, step.kv_heads, ps))
    }
}

/// StreamingLLM (Xiao et al., 2023): the attention-sink tokens plus a recent window, nothing
/// else. At `page_size` 1 (the default) it selects exactly those tokens; at a larger page size,
/// the pages that hold them.
#[derive(Clone, Debug)]
pub struct StreamingLlm {
    config: StreamingConfig,
}

/// Settings of [`StreamingLlm`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StreamingConfig {
    /// Leading tokens kept (the paper's 4).
    pub sink_tokens: u32,
    /// Trailing tokens kept, the newest included.
    pub window_tokens: u32,
    /// Tokens per selected id.
    pub page_size: usize,
}

impl Default for StreamingConfig {
    fn default() -> Self {
        StreamingConfig {
            sink_tokens: 4,
            window_tokens: 2044,
            page_size: 1,
        }
    }
}

impl StreamingLlm {
    /// Validates the configuration.
    pub fn new(config: StreamingConfig) -> Result<Self, AlgoError> {
        if config.page_size == 0 || config.window_tokens == 0 {
            return Err(AlgoError::Config(format!(
                "StreamingLLM needs a page size and a window of at least 1 (got {} and {})",
                config.page_size, config.window_tokens
            )));
        }
        Ok(StreamingLlm { config })
    }

    /// The settings.
    pub fn config(&self) -> StreamingConfig {
        self.config
    }

    /// The longest row a decode selection can have: the sink pages and the most pages the
    /// window can touch (the width of a device selection).
    pub fn row_width(&self) -> usize {
        self.always().max_forced_pages(self.config.page_size)
    }

    /// The sinks and the window as the forced pages of a row that has no budget.
    fn always(&self) -> AlwaysInclude {
        AlwaysInclude {
            sink_tokens: self.config.sink_tokens,
            recent_tokens: self.config.window_tokens,
        }
    }
}

impl SparseAlgorithm for StreamingLlm {
    fn caps(&self) -> Caps {
        Caps {
            name: "streaming_llm",
            page_size: self.config.page_size,
            decode: true,
            prefill_keep: false,
            reads_keys: false,
        }
    }

    fn max_pages(&self, _kv_heads: usize) -> Option<usize> {
        // Every head keeps the same pages.
        Some(self.row_width())
    }

    fn retrieve_topk(&self, step: &Decode<'_>, _pool: &RepPool) -> Result<TopK, AlgoError> {
        step.validate()?;
        let c = self.config;
        let always = self.always();
        let rows: Vec<Vec<i32>> = (0..step.num_seqs() * step.kv_heads)
            .map(|r| {
                Plan::new(step.seq_lens[r / step.kv_heads], c.page_size, 0, always)
                    .assemble(Vec::new())
            })
            .collect();
        Ok(TopK::from_rows(&rows, step.kv_heads, c.page_size))
    }
}
