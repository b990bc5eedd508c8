//! Integration tests of sparse-algo: one binary, one module per concern.

mod errors;
mod fuzz;
mod needles;
mod quest;
mod util;
mod widths;
