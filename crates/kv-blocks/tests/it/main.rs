//! Integration tests of kv-blocks: scenario tests named after what they prove, and a proptest
//! state machine checking the manager's invariants after every step.

mod errors;
mod eviction;
mod machine;
mod reuse;
mod sizing;
mod tiers;
mod util;
mod windows_events;
