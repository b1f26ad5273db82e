//! Runs the session runtime conformance suite against the in-memory reference runtime and prints
//! what held: `cargo run --example conformance`.

use std::sync::Arc;

use session_runtime::conformance::{run_all, Target};
use session_runtime::testing::FakeRuntime;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let runtime = Arc::new(FakeRuntime::builder().build()?);
    let target =
        Target::new(Arc::<FakeRuntime>::clone(&runtime), runtime.installation()).with_faults(runtime);
    let report = run_all(&target).await;
    for behaviour in &report.passed {
        println!("pass  {behaviour}");
    }
    for (behaviour, why) in &report.skipped {
        println!("skip  {behaviour}: {why}");
    }
    println!("{} passed, {} skipped", report.passed.len(), report.skipped.len());
    Ok(())
}
