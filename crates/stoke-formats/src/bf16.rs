//! bf16 conversions that match the kernels bit for bit (round to nearest even).

/// f32 -> bf16 bits, round to nearest, ties to even; NaN stays NaN (quiet).
pub fn from_f32(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

pub fn to_f32(bits: u16) -> f32 {
    half::bf16::from_bits(bits).to_f32()
}

/// Rounds an f32 to the nearest bf16 value.
pub fn round(x: f32) -> f32 {
    to_f32(from_f32(x))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_to_nearest_even() {
        assert_eq!(round(1.0), 1.0);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(round(1.0 + 1.0 / 256.0), 1.0);
        // Just above halfway rounds up.
        assert_eq!(round(1.0 + 1.0 / 256.0 + 1.0 / 65536.0), 1.0 + 1.0 / 128.0);
        assert!(round(f32::NAN).is_nan());
        assert_eq!(round(f32::INFINITY), f32::INFINITY);
    }
}
