//! How heapdump's settings spell a number of bytes: `524288`, `512KiB`,
//! `512K`, `2MiB`, `1GiB`, `1TiB` (binary units, case-insensitive, an
//! optional `B`). One parser for the agent (`HEAPDUMP_SAMPLE_RATE`) and the
//! dumper's flags (`run --sample-rate`, `watch --max-total`), so both
//! accept exactly the same spellings.

/// Why a byte count could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ByteSizeError {
    /// No digits where the number should be.
    #[error("not a size: {0:?} (a number of bytes, e.g. 524288, 512KiB, 2MiB)")]
    NotANumber(String),
    /// A unit other than B, KiB, MiB, GiB or TiB.
    #[error("unknown unit in {0:?} (use B, KiB, MiB, GiB or TiB)")]
    UnknownUnit(String),
    /// More than 2^64 - 1 bytes.
    #[error("{0:?} is too large")]
    TooLarge(String),
}

/// Parses a byte count (see the module doc).
pub fn parse_byte_size(v: &str) -> Result<u64, ByteSizeError> {
    let v = v.trim();
    let digits = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (n, unit) = v.split_at(digits);
    let n: u64 = n
        .parse()
        .map_err(|_| ByteSizeError::NotANumber(v.to_string()))?;
    // Compared in place: the agent parses its settings while it starts,
    // where allocating is best avoided.
    const UNITS: [(&str, u32); 14] = [
        ("", 0),
        ("b", 0),
        ("k", 10),
        ("kb", 10),
        ("kib", 10),
        ("m", 20),
        ("mb", 20),
        ("mib", 20),
        ("g", 30),
        ("gb", 30),
        ("gib", 30),
        ("t", 40),
        ("tb", 40),
        ("tib", 40),
    ];
    let unit = unit.trim();
    let Some(&(_, shift)) = UNITS.iter().find(|(u, _)| unit.eq_ignore_ascii_case(u)) else {
        return Err(ByteSizeError::UnknownUnit(v.to_string()));
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| ByteSizeError::TooLarge(v.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_parse_with_binary_units() {
        assert_eq!(parse_byte_size("524288"), Ok(524288));
        assert_eq!(parse_byte_size("512KiB"), Ok(512 << 10));
        assert_eq!(parse_byte_size("2MiB"), Ok(2 << 20));
        assert_eq!(parse_byte_size("2m"), Ok(2 << 20));
        assert_eq!(parse_byte_size("0"), Ok(0));
        assert_eq!(parse_byte_size(" 1GiB "), Ok(1 << 30));
        assert_eq!(parse_byte_size("1TiB"), Ok(1 << 40));
        assert!(matches!(
            parse_byte_size("12 parsecs"),
            Err(ByteSizeError::UnknownUnit(_))
        ));
        assert!(matches!(
            parse_byte_size("KiB"),
            Err(ByteSizeError::NotANumber(_))
        ));
        assert!(matches!(
            parse_byte_size("99999999999TiB"),
            Err(ByteSizeError::TooLarge(_))
        ));
    }
}
