//! The simulator's kernel naming convention.

/// The simulator's kernel convention: a kernel's simulated duration follows from its name.
///
/// * `sleep_<N><unit>`: runs N units (`ns`, `us`, `ms`, `s`) whatever the grid;
/// * `wave_<N><unit>`: N units per wave of blocks, one block per SM per wave
///   (`ceil(blocks / SMs)` waves);
/// * `param_ns`: the first kernel parameter (a `u64`) is the duration in ns of a wave of blocks
///   (one wave, that duration, for a grid of at most a block per SM).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelKind {
    Fixed(u64),
    PerWave(u64),
    Param,
}

pub fn parse_kernel_name(name: &str) -> Option<KernelKind> {
    if name == "param_ns" {
        return Some(KernelKind::Param);
    }
    let (kind, rest): (fn(u64) -> KernelKind, &str) = if let Some(r) = name.strip_prefix("sleep_") {
        (KernelKind::Fixed, r)
    } else if let Some(r) = name.strip_prefix("wave_") {
        (KernelKind::PerWave, r)
    } else {
        return None;
    };
    let digits = rest.find(|c: char| !c.is_ascii_digit()).unwrap_or(rest.len());
    let n: u64 = rest[..digits].parse().ok()?;
    let mult = match &rest[digits..] {
        "ns" => 1,
        "us" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        _ => return None,
    };
    Some(kind(n.checked_mul(mult)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn kernel_names() {
        assert_eq!(parse_kernel_name("sleep_50us"), Some(KernelKind::Fixed(50_000)));
        assert_eq!(parse_kernel_name("wave_2ms"), Some(KernelKind::PerWave(2_000_000)));
        assert_eq!(parse_kernel_name("param_ns"), Some(KernelKind::Param));
        assert_eq!(parse_kernel_name("sleep_5"), None);
        assert_eq!(parse_kernel_name("gemm"), None);
        assert_eq!(parse_kernel_name("sleep_ms"), None);
    }
}
