//! Kubernetes resource quantities (`resource.Quantity`): the one parser of the controller —
//! exact for the admission rules (provider resources, `hostMemory`), and as a float
//! ([`parse_quantity`]) for sizes the adapters and renderers compute with.
//!
//! Grammar (as `k8s.io/apimachinery/pkg/api/resource`): `<sign>?<digits>[.<digits>]<suffix>` with
//! suffix a binary SI unit (`Ki`…`Ei`), a decimal SI unit (`n u m "" k M G T P E`) or a decimal
//! exponent (`e3`, `E-2`). Values are held exactly as an integer count of nano-units (`i128`),
//! rounded up below one nano-unit as Kubernetes rounds up, so comparisons such as
//! `2Gi == 2048Mi` or `1000M == 1G` are exact.

/// Nano-units per unit.
pub const NANOS_PER_UNIT: i128 = 1_000_000_000;

/// A parsed quantity: its value in nano-units.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Quantity {
    nanos: i128,
}

/// Why a string is not a quantity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuantityError {
    /// Does not match the quantity grammar.
    #[error("quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'")]
    Syntax,
    /// Too large to represent.
    #[error("quantity is too large")]
    Overflow,
}

impl Quantity {
    /// Parses a quantity string.
    pub fn parse(s: &str) -> Result<Quantity, QuantityError> {
        let (negative, rest) = match s.as_bytes().first() {
            Some(b'-') => (true, &s[1..]),
            Some(b'+') => (false, &s[1..]),
            _ => (false, s),
        };
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, suffix) = rest.split_at(num_len);
        let (int_part, frac_part) = match number.split_once('.') {
            Some((i, f)) => (i, f),
            None => (number, ""),
        };
        if frac_part.contains('.') || (int_part.is_empty() && frac_part.is_empty()) {
            return Err(QuantityError::Syntax);
        }
        let (exp10, exp2) = parse_suffix(suffix)?;
        let mut mantissa: i128 = 0;
        for c in int_part.chars().chain(frac_part.chars()) {
            let d = i128::from(c.to_digit(10).ok_or(QuantityError::Syntax)?);
            mantissa = mantissa
                .checked_mul(10)
                .and_then(|m| m.checked_add(d))
                .ok_or(QuantityError::Overflow)?;
        }
        // value = mantissa * 10^(exp10 - frac_len) * 2^exp2, in nano-units: * 10^9.
        let frac_len = i32::try_from(frac_part.len()).map_err(|_| QuantityError::Overflow)?;
        let scale10 = exp10 - frac_len + 9;
        let mut nanos = mantissa;
        if exp2 > 0 {
            nanos = nanos
                .checked_mul(1i128 << exp2)
                .ok_or(QuantityError::Overflow)?;
        }
        if scale10 >= 0 {
            let f = pow10(scale10).ok_or(QuantityError::Overflow)?;
            nanos = nanos.checked_mul(f).ok_or(QuantityError::Overflow)?;
        } else {
            match pow10(-scale10) {
                Some(f) => {
                    // Round up what is finer than a nano-unit, as Kubernetes does.
                    let q = nanos / f;
                    nanos = if nanos % f != 0 { q + 1 } else { q };
                }
                None => nanos = if nanos != 0 { 1 } else { 0 },
            }
        }
        Ok(Quantity {
            nanos: if negative { -nanos } else { nanos },
        })
    }

    /// The value in nano-units.
    pub fn nanos(self) -> i128 {
        self.nanos
    }

    /// The value in units, as a float (exact up to 2^53 nano-units, then rounded).
    pub fn as_f64(self) -> f64 {
        self.nanos as f64 / NANOS_PER_UNIT as f64
    }

    /// Strictly below zero.
    pub fn is_negative(self) -> bool {
        self.nanos < 0
    }

    /// Strictly above zero.
    pub fn is_positive(self) -> bool {
        self.nanos > 0
    }

    /// A whole number of units.
    pub fn is_integer(self) -> bool {
        self.nanos % NANOS_PER_UNIT == 0
    }

    /// Whether `self` is a whole multiple of `unit` (`unit` > 0).
    pub fn is_multiple_of(self, unit: Quantity) -> bool {
        unit.nanos > 0 && self.nanos % unit.nanos == 0
    }
}

/// A quantity string (surrounding whitespace ignored) in units, e.g. `"4Gi"` → 4294967296.0,
/// `"250m"` → 0.25, `"1e3"` → 1000.0. `None` when it is not a quantity or too large
/// ([`Quantity::parse`]).
pub fn parse_quantity(s: &str) -> Option<f64> {
    Quantity::parse(s.trim()).ok().map(Quantity::as_f64)
}

fn pow10(e: i32) -> Option<i128> {
    let e = u32::try_from(e).ok()?;
    10i128.checked_pow(e)
}

/// (decimal exponent, binary exponent) of a suffix.
fn parse_suffix(s: &str) -> Result<(i32, u32), QuantityError> {
    Ok(match s {
        "" => (0, 0),
        "n" => (-9, 0),
        "u" => (-6, 0),
        "m" => (-3, 0),
        "k" => (3, 0),
        "M" => (6, 0),
        "G" => (9, 0),
        "T" => (12, 0),
        "P" => (15, 0),
        "E" => (18, 0),
        "Ki" => (0, 10),
        "Mi" => (0, 20),
        "Gi" => (0, 30),
        "Ti" => (0, 40),
        "Pi" => (0, 50),
        "Ei" => (0, 60),
        _ => {
            let rest = s
                .strip_prefix('e')
                .or_else(|| s.strip_prefix('E'))
                .ok_or(QuantityError::Syntax)?;
            let digits = rest.strip_prefix(['+', '-']).unwrap_or(rest);
            if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit()) {
                return Err(QuantityError::Syntax);
            }
            let e: i32 = rest.parse().map_err(|_| QuantityError::Overflow)?;
            if e.abs() > 40 {
                return Err(QuantityError::Overflow);
            }
            (e, 0)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(s: &str) -> Quantity {
        Quantity::parse(s).unwrap()
    }

    #[test]
    fn parses_every_suffix_exactly() {
        assert_eq!(q("1").nanos(), NANOS_PER_UNIT);
        assert_eq!(q("250m").nanos(), 250_000_000);
        assert_eq!(q("2Gi"), q("2048Mi"));
        assert_eq!(q("1G"), q("1000M"));
        assert_eq!(q("1e3"), q("1k"));
        assert_eq!(q("1E3"), q("1k"));
        assert_eq!(q("1.5Gi"), q("1536Mi"));
        assert_eq!(q(".5"), q("500m"));
        assert_eq!(q("5."), q("5"));
        assert_eq!(q("+1"), q("1"));
        assert!(q("-1").is_negative());
        assert!(!q("0").is_positive());
        assert_eq!(q("1n").nanos(), 1);
        assert_eq!(q("0.1n").nanos(), 1, "sub-nano rounds up");
        assert!(q("1Ei").is_positive());
        assert!(q("3Mi").is_integer());
        assert!(!q("500m").is_integer());
        assert!(q("4Mi").is_multiple_of(q("2Mi")));
        assert!(!q("3Mi").is_multiple_of(q("2Mi")));
    }

    #[test]
    fn rejects_malformed() {
        for bad in [
            "", "abc", "1.2.3", "5Xi", "1 Gi", "Gi", ".", "-", "1e", "1e+", "1ee3", "1Gii", " 1",
        ] {
            assert_eq!(Quantity::parse(bad), Err(QuantityError::Syntax), "{bad}");
        }
        assert_eq!(
            Quantity::parse("99999999999999999999999999999999999999999"),
            Err(QuantityError::Overflow)
        );
    }
}
