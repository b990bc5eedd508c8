//! Integration tests of the engine.

mod gguf;
