//! Allocator settings the `lease-router` binary (and the benches, to measure what it runs)
//! applies at startup. A library user keeps whatever allocator and settings they chose.
//!
//! glibc keeps freed small chunks in "fastbins" without merging them, and merges them all the
//! next time anything asks for a large chunk. Under ingest a thread frees tens of thousands of
//! small chunks between two large requests, so that one merge can take milliseconds: a scan
//! step or a batch hand-over that allocates once in a while then stalls ingest for that long
//! (seen as 5-22 ms steps of the latency bench, one to six a run). With fastbins off, freed
//! small chunks go to glibc's per-thread cache first as before and are merged as they come:
//! the same bench shows no step over 0.25 ms of CPU, at the same ingest rate.

/// Turns glibc's fastbins off (`M_MXFAST` = 0). Returns whether the setting took effect: false
/// on other C libraries, where there is nothing to do.
pub fn tune_for_latency() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` only changes glibc's allocator parameters; any value is allowed
        // at any time, and 0 is documented to disable fastbins.
        unsafe { libc::mallopt(libc::M_MXFAST, 0) == 1 }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn fastbins_can_be_turned_off() {
        assert!(super::tune_for_latency());
    }
}
