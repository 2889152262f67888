//! A check a test could not make, recorded instead of passing silently (issue 40): the reason is
//! printed and appended as one line `<test>: <reason>` to the file `$IC_TEST_SKIP_LOG` names
//! (scripts/test.sh sets it and counts each test with such a line as skipped, not passed, in its
//! verdict line). Only for conditions a machine may legitimately have (a real GPU present, no
//! `/dev/shm`); a missing prerequisite that `scripts/setup.sh` installs fails the test instead.
//! Included with `#[path = "support/skip.rs"] mod skip;` by tests that do not use `support`.

#![allow(dead_code)]

use std::io::Write;

/// The command that installs every prerequisite of the tests; a test that fails for want of one
/// names it.
pub const SETUP: &str = "scripts/setup.sh (./scripts/test.sh runs it first)";

/// Records that `test` skipped its check (or part of it) because of `reason`.
pub fn skip(test: &str, reason: &str) {
    eprintln!("skipped {test}: {reason}");
    if let Some(path) = std::env::var_os("IC_TEST_SKIP_LOG") {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("IC_TEST_SKIP_LOG={}: {e}", path.to_string_lossy()));
        // one write per line: concurrent tests append whole lines
        f.write_all(format!("{test}: {reason}\n").as_bytes())
            .unwrap_or_else(|e| panic!("IC_TEST_SKIP_LOG={}: {e}", path.to_string_lossy()));
    }
}
