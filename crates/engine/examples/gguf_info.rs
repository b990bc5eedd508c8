//! Prints a GGUF file's metadata (arrays summarized) and tensor directory.
//!
//! `cargo run --release -p engine --example gguf_info -- FILE`
#![allow(clippy::print_stdout, reason = "an example that prints what it read")]

use engine::gguf::{Gguf, Value};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path = std::env::args().nth(1).ok_or("usage: gguf_info FILE")?;
    let g = Gguf::open(path.as_ref())?;
    println!(
        "GGUF v{}: {} keys, {} tensors",
        g.version,
        g.metadata.len(),
        g.tensors.len()
    );
    for (k, v) in &g.metadata {
        match v {
            Value::Array(a) => println!("{k}: array of {}", a.len()),
            v => println!("{k}: {v:?}"),
        }
    }
    for (name, t) in &g.tensors {
        println!("{name}: {:?} {:?}", t.dtype, t.dims);
    }
    Ok(())
}
