//! Sizes as people write them, parsed one way everywhere: `vgpuctl`, the agent's configuration and
//! `libvgpu.so`'s environment (`CUDA_DEVICE_MEMORY_LIMIT` and the rest) accept the same forms.
//!
//! | form | means |
//! |---|---|
//! | `1073741824` | bytes |
//! | `0x40000000` | bytes, hexadecimal |
//! | `8k`, `512m`, `8g`, `1t` (any case) | powers of 1024, as HAMi writes them |
//! | `8Ki`/`8KiB`, `Mi`/`MiB`, `Gi`/`GiB`, `Ti`/`TiB` | powers of 1024 |
//! | `8KB`, `MB`, `GB`, `TB` | powers of 1000 |
//! | `1.5g`, `0.5GiB` | a decimal number with any of those units, rounded to a byte |
//!
//! Spaces between the number and its unit, and a trailing `b`/`B` on its own, are accepted.
#![deny(clippy::too_many_lines)]

/// What a size that cannot be parsed was, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SizeError {
    /// No number where one was expected.
    NotANumber(String),
    /// A unit this parser does not know.
    UnknownUnit { value: String, unit: String },
    /// More than 2^64 - 1 bytes.
    TooLarge(String),
}

/// The accepted forms, for error messages.
pub const FORMS: &str =
    "bytes, 0x hex, or a number with k, m, g, t (powers of 1024), KiB, MiB, GiB, TiB, or KB, MB, GB, TB";

impl std::fmt::Display for SizeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SizeError::NotANumber(v) => write!(f, "{v:?} is not a size ({FORMS})"),
            SizeError::UnknownUnit { value, unit } => write!(f, "{value:?}: unknown unit {unit:?} ({FORMS})"),
            SizeError::TooLarge(v) => write!(f, "{v:?} is too large"),
        }
    }
}

impl std::error::Error for SizeError {}

impl SizeError {
    /// What is wrong, without the value (for a message that names the value itself).
    pub fn reason(&self) -> String {
        match self {
            SizeError::NotANumber(_) => format!("is not a size ({FORMS})"),
            SizeError::UnknownUnit { unit, .. } => format!("has an unknown unit {unit:?} ({FORMS})"),
            SizeError::TooLarge(_) => "is too large".to_string(),
        }
    }
}

/// Parses a size (see the module's table).
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let t = s.trim();
    if let Some(h) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        return u64::from_str_radix(h, 16).map_err(|_| SizeError::NotANumber(s.to_string()));
    }
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(SizeError::NotANumber(s.to_string()));
    }
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "ki" | "kib" => 1 << 10,
        "m" | "mi" | "mib" => 1 << 20,
        "g" | "gi" | "gib" => 1 << 30,
        "t" | "ti" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        u => return Err(SizeError::UnknownUnit { value: s.to_string(), unit: u.to_string() }),
    };
    // Whole numbers exactly (no float rounding of large byte counts); decimals through f64.
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult).ok_or_else(|| SizeError::TooLarge(s.to_string()));
    }
    let n: f64 = num.parse().map_err(|_| SizeError::NotANumber(s.to_string()))?;
    let v = n * mult as f64;
    if !v.is_finite() || v >= u64::MAX as f64 {
        return Err(SizeError::TooLarge(s.to_string()));
    }
    Ok(v.round() as u64)
}

/// A size for people: `1.5 GiB`, `512.0 MiB`, `0 B` (powers of 1024, one decimal).
pub fn human(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_form_of_the_table_means_what_it_says() {
        for (s, want) in [
            ("1073741824", 1u64 << 30),
            ("0x40000000", 1 << 30),
            ("8g", 8 << 30),
            ("8G", 8 << 30),
            ("8192m", 8 << 30),
            ("8GiB", 8 << 30),
            ("8 GiB", 8 << 30),
            ("8Gi", 8 << 30),
            ("512k", 512 << 10),
            ("1t", 1 << 40),
            ("8GB", 8_000_000_000),
            ("8MB", 8_000_000),
            ("8KB", 8_000),
            ("8TB", 8_000_000_000_000),
            ("1.5g", 3 << 29),
            ("0.5GiB", 1 << 29),
            ("4096b", 4096),
            (" 64m ", 64 << 20),
        ] {
            assert_eq!(parse_size(s), Ok(want), "{s}");
        }
        // Whole byte counts beyond f64's exact range stay exact.
        assert_eq!(parse_size("18446744073709551615"), Ok(u64::MAX));
    }

    #[test]
    fn bad_sizes_are_refused_with_the_value_and_the_forms() {
        let e = parse_size("8 gigs").unwrap_err().to_string();
        assert!(e.contains("\"8 gigs\"") && e.contains("unknown unit \"gigs\"") && e.contains("KiB"), "{e}");
        assert!(parse_size("lots").unwrap_err().to_string().contains("is not a size"));
        assert!(matches!(parse_size("16777216t"), Err(SizeError::TooLarge(_))));
        assert!(matches!(parse_size("0xzz"), Err(SizeError::NotANumber(_))));
        assert!(matches!(parse_size(""), Err(SizeError::NotANumber(_))));
    }

    #[test]
    fn human_sizes_read_as_powers_of_1024() {
        assert_eq!(human(0), "0 B");
        assert_eq!(human(1023), "1023 B");
        assert_eq!(human(1536 << 20), "1.5 GiB");
        assert_eq!(human(8 << 30), "8.0 GiB");
        assert_eq!(human(7_516_192_768), "7.0 GiB");
        assert_eq!(parse_size(&human(8 << 30)), Ok(8 << 30));
    }
}
