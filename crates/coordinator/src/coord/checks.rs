//! The checks the hooks make before they change anything.

use attn_op::Element;
use kv_blocks::RequestId;

use super::{Forward, SparseCoordinator};
use crate::{CoordError, RequestTracker};

impl<T: Element> SparseCoordinator<T> {
    /// That `id` is new and its prompt not empty.
    pub(super) fn check_new(&self, id: RequestId, prompt_len: usize) -> Result<(), CoordError> {
        if self.trackers.contains_key(&id) {
            return Err(CoordError::DuplicateRequest(id));
        }
        if prompt_len == 0 {
            return Err(CoordError::Invalid(format!("{id:?} has an empty prompt")));
        }
        Ok(())
    }

    /// The tracker of `id`, or the error that names it as unknown.
    pub(super) fn tracked(&self, id: RequestId) -> Result<&RequestTracker, CoordError> {
        self.trackers.get(&id).ok_or(CoordError::UnknownRequest(id))
    }

    /// Checks a layer hook: a forward in progress and the layer not ended; answers the forward.
    pub(crate) fn check_layer(&self, layer: usize) -> Result<&Forward, CoordError> {
        let f = self
            .forward
            .as_ref()
            .ok_or_else(|| CoordError::Invalid("no forward in progress".into()))?;
        if layer >= self.model.layers || f.ended[layer] {
            return Err(CoordError::Invalid(format!(
                "layer {layer} is out of range or has ended"
            )));
        }
        Ok(f)
    }

    /// [`check_layer`](Self::check_layer), and the batch's shapes: `q`, `k` and `v` elements.
    pub(crate) fn check_layer_io(
        &self,
        layer: usize,
        q: Option<usize>,
        k: usize,
        v: usize,
    ) -> Result<(), CoordError> {
        let f = self.check_layer(layer)?;
        let m = self.model;
        if let Some(q) = q {
            self.check_rows(f, "q", q, m.q_heads)?;
        }
        self.check_rows(f, "k", k, m.kv_heads)?;
        self.check_rows(f, "v", v, m.kv_heads)
    }

    /// That `got` elements are one row of `heads` heads per token of the forward `f`.
    pub(crate) fn check_rows(
        &self,
        f: &Forward,
        what: &str,
        got: usize,
        heads: usize,
    ) -> Result<(), CoordError> {
        let d = self.model.head_dim;
        // Saturating: a product that overflows matches no slice's length.
        if got == crate::config::product(&[f.tokens, heads, d]) {
            Ok(())
        } else {
            Err(CoordError::Invalid(format!(
                "{what} of {got} elements for {} tokens of {heads} heads of {d}",
                f.tokens
            )))
        }
    }
}
