//! Per-request state.

/// Whether a request runs hierarchical sparse attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Every layer attends densely over the engine's own device KV.
    Dense,
    /// Sparse layers keep the KV in the host pool and a hot buffer on the device.
    Sparse,
}

/// Where a request is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Prompt tokens are being prefilled (densely; sparse layers back them up to the host).
    Prefill,
    /// One token per forward; sparse layers select, diff and attend over the hot buffer.
    Decode,
}

/// What the coordinator knows of one request (SGLang's RequestTracker).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestTracker {
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Tokens whose KV is stored (committed at each `forward_end`).
    pub len: usize,
    /// Dense or sparse.
    pub mode: Mode,
    /// Prefill or decode.
    pub phase: Phase,
    /// The representation slot (sparse mode).
    pub slot: Option<usize>,
    /// Tokens of a reused prefix that were already in the host pool at the start.
    pub reused_tokens: usize,
    /// Whether every sparse layer's representations are built.
    pub represented: bool,
}
