//! The user's sparse configuration and its lowering into per-layer parameters.

use std::sync::Arc;

use offload::HostLayout;
use serde::{Deserialize, Serialize};
use sparse_algo::{AlgoConfig, Caps, Indexer, QuestConfig, SparseAlgorithm, Summary};

use crate::{CoordError, ModelShape};

/// What a user writes: the algorithm, the hot buffer, which layers stay dense, and per-layer
/// overrides. In TOML:
///
/// ```
/// use coordinator::{ModelShape, SparseConfig};
///
/// let c: SparseConfig = toml::from_str(r#"
///     hot_tokens = 4096
///     dense_layers = [0, 1]
///     [algo]
///     algorithm = "quest"
///     budget_tokens = 1024
///     shared_heads = true
///     [[layer]]
///     layers = [5]
///     budget_tokens = 2048
/// "#)?;
/// let lowered = c.lower(ModelShape { layers: 8, q_heads: 8, kv_heads: 2, head_dim: 64 }, None)?;
/// assert!(lowered.layers[0].is_none() && lowered.layers[2].is_some());
/// assert_eq!(lowered.layers[5].as_ref().map(|p| p.max_pages), Some(128));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Backends never read this type: [`SparseConfig::lower`] turns it into [`Lowered`] once.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SparseConfig {
    /// The algorithm of every sparse layer. Default: Quest, pages of 16, 2048 tokens, one
    /// selection shared by the KV heads.
    pub algo: AlgoConfig,
    /// Device hot-buffer tokens per (request, layer), besides the current page. Default: twice
    /// what one step can select. Must hold at least that.
    pub hot_tokens: Option<usize>,
    /// Shortest prompt that runs in sparse mode; shorter ones stay dense. Default: the hot
    /// buffer size (a shorter prompt fits in the hot buffer whole).
    pub min_prompt_tokens: Option<usize>,
    /// Layers attended densely (their KV stays on the device).
    pub dense_layers: Vec<usize>,
    /// Per-layer overrides, applied in order (TOML `[[layer]]`).
    pub layer: Vec<LayerOverride>,
    /// Layout of the host KV pool.
    pub host_layout: HostLayout,
    /// Load each sparse layer's pages early: the engine estimates the layer's queries from
    /// the layer before's input and prefetches what they select
    /// ([`SparseCoordinator::prefetch`](crate::SparseCoordinator::prefetch)), so fewer loads
    /// wait in the layer's own step; attention is unchanged. The engine does it on the CPU
    /// hooks (single requests and its scheduler); the device path refuses the option.
    /// Default: off.
    pub prefetch: bool,
}

impl Default for SparseConfig {
    fn default() -> Self {
        SparseConfig::quest(QuestConfig::default().budget_tokens)
    }
}

/// Settings of some layers that differ from the rest.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LayerOverride {
    /// The layers it applies to.
    pub layers: Vec<usize>,
    /// Another algorithm (the page size must stay the same).
    pub algo: Option<AlgoConfig>,
    /// Another budget in tokens.
    pub budget_tokens: Option<usize>,
    /// Attend these layers densely.
    pub dense: bool,
}

/// The lowered configuration: what backends read.
#[derive(Clone)]
pub struct Lowered {
    /// Per layer, its sparse parameters; `None`: a dense layer.
    pub layers: Vec<Option<LayerParams>>,
    /// Tokens per page of every sparse layer (1: token-level).
    pub page_size: usize,
    /// Hot-buffer pages per (request, layer).
    pub hot_pages: usize,
    /// Shortest prompt that runs in sparse mode.
    pub min_prompt_tokens: usize,
    /// Layout of the host KV pool.
    pub host_layout: HostLayout,
    /// Whether the engine prefetches each sparse layer's estimated selection
    /// ([`SparseConfig::prefetch`]).
    pub prefetch: bool,
}

impl std::fmt::Debug for Lowered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lowered")
            .field("layers", &self.layers)
            .field("page_size", &self.page_size)
            .field("hot_pages", &self.hot_pages)
            .field("min_prompt_tokens", &self.min_prompt_tokens)
            .field("host_layout", &self.host_layout)
            .field("prefetch", &self.prefetch)
            .finish()
    }
}

/// One sparse layer's parameters.
#[derive(Clone)]
pub struct LayerParams {
    /// The layer's algorithm configuration (the user's, with overrides applied).
    pub config: AlgoConfig,
    /// The built algorithm.
    pub algo: Arc<dyn SparseAlgorithm>,
    /// Its capabilities.
    pub caps: Caps,
    /// Most distinct pages one decode step can select over all KV heads (the hot buffer must
    /// hold them).
    pub max_pages: usize,
}

impl std::fmt::Debug for LayerParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LayerParams")
            .field("config", &self.config)
            .field("caps", &self.caps)
            .field("max_pages", &self.max_pages)
            .finish()
    }
}

impl Lowered {
    /// The shortest prompt that runs in sparse mode ([`min_prompt_tokens`](Self::min_prompt_tokens)),
    /// or `None` where no layer is sparse and every request runs dense.
    pub fn sparse_from(&self) -> Option<usize> {
        self.layers
            .iter()
            .any(Option::is_some)
            .then_some(self.min_prompt_tokens)
    }

    /// Device bytes one sparse-mode request holds on a model of shape `model` with KV
    /// elements of `elem_bytes` bytes: in every sparse layer, the hot buffer and the reserved
    /// page of KV, plus the representations of `tokens` tokens as the device keeps them: an
    /// element of the KV's type per value, or a byte per value and a scale byte per vector for
    /// Quest's E4M3 bounds. Dense layers' KV is not counted: it lives wherever the backend
    /// keeps dense KV.
    pub fn sparse_device_bytes(
        &self,
        model: ModelShape,
        elem_bytes: usize,
        tokens: usize,
    ) -> usize {
        let slots = self
            .hot_pages
            .saturating_add(1)
            .saturating_mul(self.page_size);
        let pages = tokens.div_ceil(self.page_size);
        self.layers
            .iter()
            .flatten()
            .map(|p| {
                let kv = product(&[slots, 2, model.kv_heads, model.head_dim, elem_bytes]);
                kv.saturating_add(rep_page_bytes(p, model, elem_bytes).saturating_mul(pages))
            })
            .fold(0, usize::saturating_add)
    }
}

/// Device bytes of one page of a layer's representations: an element of the KV's type per
/// value (the device pool's `T`), or, for Quest's [`Summary::E4m3`], a byte per value and a
/// scale byte per vector (sparse_algo's `DeviceRepPool`).
fn rep_page_bytes(p: &LayerParams, model: ModelShape, elem_bytes: usize) -> usize {
    let shape = p.algo.rep_shape(model.kv_heads, model.head_dim);
    match &p.config {
        AlgoConfig::Quest(q) if q.summary == Summary::E4m3 => {
            shape.page_len().saturating_add(shape.heads)
        }
        _ => shape.page_len().saturating_mul(elem_bytes),
    }
}

/// The product of `factors`, saturating at `usize::MAX`: byte counts of shapes past the
/// address space stay an upper bound instead of wrapping.
pub(crate) fn product(factors: &[usize]) -> usize {
    factors.iter().fold(1, |a, &b| a.saturating_mul(b))
}

impl SparseConfig {
    /// The default configuration (Quest, pages of 16, one selection shared by the KV heads)
    /// with a budget of `budget_tokens` per step.
    pub fn quest(budget_tokens: usize) -> Self {
        SparseConfig {
            algo: AlgoConfig::Quest(QuestConfig {
                budget_tokens,
                shared_heads: true,
                ..QuestConfig::default()
            }),
            hot_tokens: None,
            min_prompt_tokens: None,
            dense_layers: Vec::new(),
            layer: Vec::new(),
            host_layout: HostLayout::default(),
            prefetch: false,
        }
    }

    /// Validates the configuration for a model and builds each sparse layer's algorithm.
    /// `indexer` is the model's trained DSA indexer, if any.
    pub fn lower(
        &self,
        model: ModelShape,
        indexer: Option<&Arc<dyn Indexer>>,
    ) -> Result<Lowered, CoordError> {
        model.validate()?;
        let mut per_layer: Vec<Option<AlgoConfig>> = vec![Some(self.algo.clone()); model.layers];
        let check = |l: usize| {
            if l < model.layers {
                Ok(l)
            } else {
                Err(CoordError::Config(format!(
                    "layer {l} of a model of {} layers",
                    model.layers
                )))
            }
        };
        for &l in &self.dense_layers {
            per_layer[check(l)?] = None;
        }
        for o in &self.layer {
            for &l in &o.layers {
                let slot = &mut per_layer[check(l)?];
                if o.dense {
                    *slot = None;
                    continue;
                }
                let mut c = o
                    .algo
                    .clone()
                    .or_else(|| slot.clone())
                    .unwrap_or_else(|| self.algo.clone());
                if let Some(b) = o.budget_tokens {
                    c = c.with_budget(b);
                }
                *slot = Some(c);
            }
        }
        let mut layers = Vec::with_capacity(model.layers);
        let mut page_size = None;
        for (l, c) in per_layer.iter().enumerate() {
            let Some(c) = c else {
                layers.push(None);
                continue;
            };
            let algo: Arc<dyn SparseAlgorithm> = Arc::from(c.build(indexer.cloned())?);
            let caps = algo.caps();
            let max_pages = algo.max_pages(model.kv_heads).ok_or_else(|| {
                CoordError::Config(format!(
                    "layer {l}: {} has no bounded decode selection; list the layer in \
                     dense_layers",
                    caps.name
                ))
            })?;
            match page_size {
                None => page_size = Some(caps.page_size),
                Some(p) if p != caps.page_size => {
                    return Err(CoordError::Config(format!(
                        "layer {l}: pages of {} tokens, other sparse layers use {p}",
                        caps.page_size
                    )));
                }
                Some(_) => {}
            }
            layers.push(Some(LayerParams {
                config: c.clone(),
                algo,
                caps,
                max_pages,
            }));
        }
        let page_size = page_size.unwrap_or(1);
        let need = layers
            .iter()
            .flatten()
            .map(|p| p.max_pages)
            .max()
            .unwrap_or(1);
        let hot_pages = match self.hot_tokens {
            None => need.checked_mul(2).ok_or_else(|| {
                CoordError::Config(format!(
                    "one step can select {need} pages: no hot buffer holds twice that"
                ))
            })?,
            Some(t) if t / page_size >= need => t / page_size,
            Some(t) => {
                return Err(CoordError::Config(format!(
                    "hot_tokens {t} hold {} pages; one step can select {need} (HOT >= top-k)",
                    t / page_size
                )));
            }
        };
        Ok(Lowered {
            layers,
            page_size,
            hot_pages,
            // A hot buffer of more tokens than `usize` counts is one no prompt fills.
            min_prompt_tokens: self
                .min_prompt_tokens
                .unwrap_or(hot_pages.saturating_mul(page_size)),
            host_layout: self.host_layout,
            prefetch: self.prefetch,
        })
    }
}
