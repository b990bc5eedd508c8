//! Integration tests of the engine.

mod capacity;
mod ggml;
mod gguf;
mod hf;
mod model;
mod real;
mod sched;
