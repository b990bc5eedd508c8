//! Integration tests of the engine.

mod gguf;
mod model;
mod real;
mod sched;
