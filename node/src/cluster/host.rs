//! What a node can tell about its own host: its name, and whether a process on it is
//! alive (so a restart in place can take its node id over at once).

/// Whether process `pid` on this host is alive (not gone, not a zombie). Where that
/// cannot be told (no `/proc`), it counts as alive, and a restart waits to see whether
/// its registration is renewed.
pub(crate) fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which is in parentheses.
        Ok(stat) => stat.rsplit_once(')').is_none_or(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => !std::path::Path::new("/proc/self").exists(),
    }
}

/// This host's name (`/etc/hostname`), or `unknown`.
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/etc/hostname").map(|h| h.trim().to_owned()).unwrap_or_else(|_| "unknown".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_is_alive_and_the_host_has_a_name() {
        assert!(process_alive(std::process::id()));
        assert!(!host_name().is_empty());
    }
}
