//! Integration tests of offload: one binary, one module per concern.

mod decode;
mod errors;
mod exec;
mod machine;
mod shared;
mod util;
