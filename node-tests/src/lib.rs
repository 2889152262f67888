//! Privileged integration tests live in `tests/` (run as root; see README).
