//! The one place ttrace asks the CPU which vector instructions it has, and the one way its
//! kernels choose between a vectorized body and the plain one (as half-rs keeps `arch/` and
//! faer dispatches through pulp).
//!
//! Every vectorized kernel gives the same bits as its plain twin — the same IEEE operations in
//! the same order per lane, tested against it — so the choice changes speed, never a result.
//! [`has`] answers from the standard library's detection (cached by it after the first call);
//! [`dispatch!`] picks a body with it. On other architectures nothing is detected and the plain
//! bodies run.

/// A set of x86-64 instructions a kernel is compiled for (`#[target_feature(enable = …)]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(dead_code)] // every variant is used on x86-64 only
pub(crate) enum Isa {
    /// AVX2.
    Avx2,
    /// AVX2 and FMA.
    Avx2Fma,
    /// AVX and F16C (the half-precision conversions).
    AvxF16c,
    /// AVX2 and F16C.
    Avx2F16c,
}

/// Whether this CPU runs code compiled for `isa` (never, off x86-64).
#[inline]
pub(crate) fn has(isa: Isa) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as d;
        match isa {
            Isa::Avx2 => d!("avx2"),
            Isa::Avx2Fma => d!("avx2") && d!("fma"),
            Isa::AvxF16c => d!("avx") && d!("f16c"),
            Isa::Avx2F16c => d!("avx2") && d!("f16c"),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = isa;
        false
    }
}

/// `dispatch!(Avx2 => unsafe { fast(…) }, plain(…))`: the value of the vectorized call where
/// the CPU has the [`Isa`], else of the plain one. The fast expression is compiled on x86-64
/// only (it may name functions that exist there only) and is evaluated only after [`has`]
/// said yes — which is what makes its `unsafe` call of a `#[target_feature]` function sound.
macro_rules! dispatch {
    ($isa:ident => $fast:expr, $plain:expr $(,)?) => {{
        #[cfg(target_arch = "x86_64")]
        let out = if $crate::arch::has($crate::arch::Isa::$isa) {
            $fast
        } else {
            $plain
        };
        #[cfg(not(target_arch = "x86_64"))]
        let out = $plain;
        out
    }};
}
pub(crate) use dispatch;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detection_agrees_with_the_standard_library_and_dispatch_follows_it() {
        #[cfg(target_arch = "x86_64")]
        {
            assert_eq!(has(Isa::Avx2), std::arch::is_x86_feature_detected!("avx2"));
            assert_eq!(
                has(Isa::Avx2Fma),
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            );
        }
        #[cfg(not(target_arch = "x86_64"))]
        assert!(!has(Isa::Avx2));
        let picked: &str = dispatch!(Avx2 => "fast", "plain");
        assert_eq!(picked == "fast", has(Isa::Avx2));
    }
}
