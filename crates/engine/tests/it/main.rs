//! Integration tests of the engine.

mod gguf;
mod hf;
mod model;
mod real;
mod sched;
