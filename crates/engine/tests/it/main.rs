//! Integration tests of the engine.

mod capacity;
mod cli;
mod ggml;
mod gguf;
mod hf;
mod model;
mod real;
mod sched;
