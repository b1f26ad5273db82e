//! Prints the `OabSession` custom resource definition as the chart installs it
//! (`deploy/helm/openab-session-runtime/crds/oabsessions.yaml`; `scripts/chart render` runs this).

fn main() -> Result<(), serde_json::Error> {
    println!("# OabSession: a session's anchor, derived from crates/runtime-kubernetes/src/anchor.rs by");
    println!("# scripts/chart render (cargo run -p runtime-kubernetes --example oabsession-crd): edit the");
    println!("# Rust type, then render again (a unit test fails while the two differ).");
    println!(
        "{}",
        serde_json::to_string_pretty(&runtime_kubernetes::anchor::definition())?
    );
    Ok(())
}
