//! Integration tests of the coordinator: one binary, one module per concern.

mod config;
mod decode;
mod errors;
mod prefetch;
mod prefix;
mod util;
