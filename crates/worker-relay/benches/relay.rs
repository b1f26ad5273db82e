//! Relay benchmarks (placeholder).

fn main() {}
