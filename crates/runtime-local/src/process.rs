//! Processes as the runtime records and recognises them: a pid plus its start time, so a reused
//! pid is never mistaken for a worker.

use std::fs;
use std::io;

use serde::{Deserialize, Serialize};

/// A process, identified by pid and the kernel's start time (clock ticks since boot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(crate) struct ProcessRef {
    pub(crate) pid: u32,
    pub(crate) start_time: u64,
}

/// The fields of `/proc/<pid>/stat` the runtime uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcStat {
    pub(crate) ppid: u32,
    pub(crate) pgid: u32,
    pub(crate) start_time: u64,
    pub(crate) zombie: bool,
}

/// Reads a file of `/proc`, whose size the kernel reports as 0, into a buffer of `capacity`
/// bytes (grown if needed): usually one read and the one that sees its end, where
/// `fs::read_to_string` would ask for its size, then start small and double, one read per step.
/// Bytes that are not UTF-8 (a command name may hold any) are replaced, not an error.
pub(crate) fn read_proc(path: impl AsRef<std::path::Path>, capacity: usize) -> io::Result<String> {
    read_all(&mut fs::File::open(path)?, capacity)
}

/// The rest of `file`, read as [`read_proc`] reads.
pub(crate) fn read_all(file: &mut fs::File, capacity: usize) -> io::Result<String> {
    let mut bytes = Vec::with_capacity(capacity);
    io::Read::read_to_end(&mut io::Read::take(file, u64::MAX), &mut bytes)?;
    Ok(match String::from_utf8(bytes) {
        Ok(text) => text,
        Err(invalid) => String::from_utf8_lossy(invalid.as_bytes()).into_owned(),
    })
}

/// Reads `/proc/<pid>/stat`; `None` if the process does not exist.
pub(crate) fn stat(pid: u32) -> Option<ProcStat> {
    // A stat line is about 300 bytes (52 fields and the command name).
    let text = read_proc(format!("/proc/{pid}/stat"), 1024).ok()?;
    parse_stat(&text)
}

fn parse_stat(text: &str) -> Option<ProcStat> {
    // The command name is in parentheses and may itself contain ") ": split at the last one.
    let (_, rest) = text.rsplit_once(") ")?;
    let fields: Vec<&str> = rest.split_ascii_whitespace().collect();
    // `rest` starts at field 3 (state); field n is at index n - 3.
    Some(ProcStat {
        zombie: matches!(*fields.first()?, "Z" | "X"),
        ppid: fields.get(1)?.parse().ok()?,
        pgid: fields.get(2)?.parse().ok()?,
        start_time: fields.get(19)?.parse().ok()?,
    })
}

impl ProcessRef {
    /// The process `pid` as it is now.
    pub(crate) fn of(pid: u32) -> Option<Self> {
        stat(pid).map(|s| Self {
            pid,
            start_time: s.start_time,
        })
    }

    /// This process.
    pub(crate) fn current() -> Self {
        let pid = std::process::id();
        Self::of(pid).unwrap_or(Self { pid, start_time: 0 })
    }

    /// Whether this very process (same pid and start time) still runs (zombies count as gone).
    pub(crate) fn is_alive(&self) -> bool {
        stat(self.pid).is_some_and(|s| s.start_time == self.start_time && !s.zombie)
    }
}

/// Every descendant of `root` (not `root` itself), found through `/proc/<pid>/task/*/children`.
pub(crate) fn descendants(root: u32) -> Vec<u32> {
    let mut found = Vec::new();
    let mut queue = vec![root];
    while let Some(pid) = queue.pop() {
        let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let Ok(children) = fs::read_to_string(task.path().join("children")) else {
                continue;
            };
            for child in children
                .split_ascii_whitespace()
                .filter_map(|c| c.parse::<u32>().ok())
            {
                if !found.contains(&child) {
                    found.push(child);
                    queue.push(child);
                }
            }
        }
    }
    found
}

/// The rest of the first `KEY=value` entry of `pid`'s initial environment that starts with
/// `prefix`; `None` if it has none (or is gone, or is not readable).
pub(crate) fn environment_entry(pid: u32, prefix: &str) -> Option<String> {
    let env = fs::read(format!("/proc/{pid}/environ")).ok()?;
    let entry = env
        .split(|b| *b == 0)
        .find_map(|entry| entry.strip_prefix(prefix.as_bytes()))?;
    Some(String::from_utf8_lossy(entry).into_owned())
}

/// Every process whose initial environment has a `KEY=value` entry starting with `prefix`, with
/// the rest of that entry.
pub(crate) fn with_environment_prefix(prefix: &str) -> Vec<(u32, String)> {
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
        .filter_map(|pid| Some((pid, environment_entry(pid, prefix)?)))
        .collect()
}

/// Every process whose initial environment contains exactly `marker` (`KEY=value`).
pub(crate) fn with_environment_entry(marker: &str) -> Vec<u32> {
    with_environment_prefix(marker)
        .into_iter()
        .filter(|(_, rest)| rest.is_empty())
        .map(|(pid, _)| pid)
        .collect()
}

/// Sends `signal` to the process tree rooted at `root`: its process group, and every descendant
/// (which covers sandboxed children that started sessions of their own).
///
/// A pid is only trusted together with its start time: if `root.pid` now belongs to another
/// process, the worker and its group are long gone and nothing is signalled. If no process has
/// that pid, members of its group that outlived it are signalled (the kernel does not reuse a pid
/// while a process group of that id exists).
pub(crate) fn signal_tree(root: ProcessRef, signal: rustix::process::Signal) -> io::Result<()> {
    signal_from(root, signal, true);
    Ok(())
}

/// [`signal_tree`] without the walk of descendants: `root`'s process group and `root` itself,
/// for a caller that reaches the rest of the tree another way (its cgroup's members).
pub(crate) fn signal_group(root: ProcessRef, signal: rustix::process::Signal) {
    signal_from(root, signal, false);
}

fn signal_from(root: ProcessRef, signal: rustix::process::Signal, descendants_too: bool) {
    let send = |pid: u32, group: bool| {
        if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
            let _ = if group {
                rustix::process::kill_process_group(pid, signal)
            } else {
                rustix::process::kill_process(pid, signal)
            };
        }
    };
    match stat(root.pid) {
        Some(now) if now.start_time == root.start_time => {
            let tree = if descendants_too {
                descendants(root.pid)
            } else {
                Vec::new()
            };
            send(root.pid, true);
            send(root.pid, false);
            for pid in tree {
                send(pid, false);
            }
        }
        Some(_) => {}
        None => send(root.pid, true),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_parsing_survives_hostile_command_names() {
        let line = "4242 (a) b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10";
        let stat = parse_stat(line).expect("parses");
        assert_eq!(
            (stat.ppid, stat.pgid, stat.start_time, stat.zombie),
            (1, 4242, 987654, false)
        );
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(parse_stat("1 (x) Z 0"), None);
    }

    #[test]
    fn the_current_process_is_alive_and_a_changed_start_time_is_not() {
        let me = ProcessRef::current();
        assert!(me.is_alive());
        assert!(!ProcessRef {
            start_time: me.start_time + 1,
            ..me
        }
        .is_alive());
    }

    #[test]
    fn descendants_include_grandchildren() {
        let mut child = std::process::Command::new("/bin/sh")
            .args(["-c", "sleep 30 & wait"])
            .spawn()
            .expect("spawn sh");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut found = Vec::new();
        while found.is_empty() && std::time::Instant::now() < deadline {
            found = descendants(child.id());
        }
        let _ = child.kill();
        let _ = child.wait();
        for pid in &found {
            if let Some(pid) = rustix::process::Pid::from_raw(*pid as i32) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
        assert_eq!(
            found.len(),
            1,
            "the shell's sleep is its one descendant: {found:?}"
        );
    }
}
