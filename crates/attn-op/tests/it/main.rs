//! Integration tests of attn-op: properties against a naive f64 oracle, exact equalities between
//! entry points, and typed errors for bad inputs.

mod errors;
mod exp;
mod fuzz;
mod oracle;
mod props;
