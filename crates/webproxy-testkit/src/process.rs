//! What a child process has cost so far, read from `/proc` (Linux only): its CPU time,
//! its peak resident memory and its threads, and its resident memory now. The bench
//! divides the first two by the conversations served, and samples the last; tests
//! bound them.

use std::fs;
use std::process::Command;
use std::time::Duration;

/// The CPU time (user and system) process `pid` has used so far, from
/// `/proc/<pid>/stat`, in clock ticks of `getconf CLK_TCK`.
pub fn cpu_time(pid: u32) -> Duration {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))
        .unwrap_or_else(|e| panic!("read /proc/{pid}/stat: {e}"));
    // The command name, field 2, is in parentheses and may hold spaces; utime and
    // stime are fields 14 and 15, so the 12th and 13th after it.
    let after_name = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .unwrap_or_else(|| panic!("unexpected /proc/{pid}/stat: {stat}"));
    let ticks: u64 = after_name
        .split_whitespace()
        .skip(11)
        .take(2)
        .map(|field| field.parse::<u64>().expect("utime and stime are numbers"))
        .sum();
    Duration::from_secs_f64(ticks as f64 / clock_ticks_per_second() as f64)
}

/// Process `pid`'s peak resident set so far, in bytes (`VmHWM` in
/// `/proc/<pid>/status`); `None` once it exited.
pub fn peak_rss(pid: u32) -> Option<u64> {
    status_bytes(pid, "VmHWM:")
}

/// Process `pid`'s resident set now, in bytes (`VmRSS` in `/proc/<pid>/status`);
/// `None` once it exited. Sampled, it shows when a peak came.
pub fn rss(pid: u32) -> Option<u64> {
    status_bytes(pid, "VmRSS:")
}

/// A `kB` field of `/proc/<pid>/status` (`field` with its colon), in bytes.
fn status_bytes(pid: u32, field: &str) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix(field))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// How many threads process `pid` has now (`Threads` in `/proc/<pid>/status`);
/// `None` once it exited. A blocking call (getaddrinfo on tokio's blocking pool) holds
/// one each.
pub fn threads(pid: u32) -> Option<u64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("Threads:"))?
        .trim()
        .parse()
        .ok()
}

/// `getconf CLK_TCK`: the unit of `/proc/<pid>/stat`'s times (100 on Linux).
fn clock_ticks_per_second() -> u64 {
    static TICKS: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        let output = Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .expect("run `getconf CLK_TCK`");
        String::from_utf8_lossy(&output.stdout)
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("`getconf CLK_TCK` gave {output:?}: {e}"))
    })
}
