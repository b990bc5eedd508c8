//! Integration tests of the coordinator: one binary, one module per concern.

mod config;
mod decode;
mod errors;
mod machine;
mod prefetch;
mod prefix;
mod util;
