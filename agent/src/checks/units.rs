//! Byte quantities for messages and mount options.

/// Formats a byte count in binary units with one decimal: `512 B`, `1.5 KiB`, `64.0 MiB`,
/// `1.0 GiB`, up to `EiB`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// `"<human> (<n> bytes)"`, e.g. `64.0 MiB (67108864 bytes)`: what messages print so that a
/// person reads the size and a script can grep the exact number.
pub fn bytes_both(bytes: u64) -> String {
    format!("{} ({bytes} bytes)", human_bytes(bytes))
}

/// Parses a tmpfs `size=` option value as the kernel prints or accepts it: a plain byte
/// count or a number with a binary suffix `k`, `m`, `g`, `t`, `p`, `e` (either case).
///
/// Returns `None` for anything else, including percentages (`50%`), which depend on RAM.
pub fn parse_size_option(value: &str) -> Option<u64> {
    let value = value.trim();
    let (digits, shift) = match value.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_lowercase() {
                'k' => 10,
                'm' => 20,
                'g' => 30,
                't' => 40,
                'p' => 50,
                'e' => 60,
                _ => return None,
            };
            (&value[..i], shift)
        }
        Some(_) => (value, 0),
        None => return None,
    };
    let n: u64 = digits.parse().ok()?;
    n.checked_mul(1u64 << shift)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
mod tests {
    use super::*;

    #[test]
    fn human_units() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(64 << 20), "64.0 MiB");
        assert_eq!(human_bytes(1 << 30), "1.0 GiB");
        assert_eq!(human_bytes(u64::MAX), "16.0 EiB");
        assert_eq!(bytes_both(67108864), "64.0 MiB (67108864 bytes)");
    }

    #[test]
    fn size_options() {
        assert_eq!(parse_size_option("24684092k"), Some(24684092 * 1024));
        assert_eq!(parse_size_option("65536k"), Some(64 << 20));
        assert_eq!(parse_size_option("1G"), Some(1 << 30));
        assert_eq!(parse_size_option("4096"), Some(4096));
        assert_eq!(parse_size_option("50%"), None);
        assert_eq!(parse_size_option(""), None);
        assert_eq!(parse_size_option("k"), None);
        assert_eq!(parse_size_option("99999999999e"), None);
    }
}
