//! Integration tests of offload: one binary, one module per concern.

mod decode;
mod errors;
mod machine;
mod util;
