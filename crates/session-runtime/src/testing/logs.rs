//! What a runtime logs, captured for a test to check.

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

/// Every `tracing` event of this test binary, at every level, formatted without time or colour.
/// One global subscriber, because runtimes log from the tasks they spawn, on any thread.
#[derive(Debug, Clone, Default)]
pub struct CapturedLogs(Arc<Mutex<Vec<u8>>>);

impl Write for CapturedLogs {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .map_err(|_| std::io::Error::other("a test panicked while logging"))?
            .extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl CapturedLogs {
    /// The capture, installed as the global subscriber on first use.
    ///
    /// # Panics
    /// If something else set the global subscriber first.
    pub fn global() -> &'static CapturedLogs {
        static LOGS: OnceLock<CapturedLogs> = OnceLock::new();
        LOGS.get_or_init(|| {
            let logs = CapturedLogs::default();
            let subscriber = tracing_subscriber::fmt()
                .with_writer({
                    let logs = logs.clone();
                    move || logs.clone()
                })
                .with_ansi(false)
                .without_time()
                .with_max_level(tracing::Level::TRACE)
                .finish();
            tracing::subscriber::set_global_default(subscriber)
                .expect("CapturedLogs must be this test binary's only global subscriber");
            logs
        })
    }

    /// The captured lines that contain `marker`.
    pub fn lines_with(&self, marker: &str) -> Vec<String> {
        let bytes = match self.0.lock() {
            Ok(bytes) => bytes.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        };
        String::from_utf8_lossy(&bytes)
            .lines()
            .filter(|line| line.contains(marker))
            .map(str::to_owned)
            .collect()
    }
}
