//! The partitioner: FNV-1a 64-bit over the key's UTF-8 bytes, modulo the partition count.
//!
//! It is part of the wire format: producers in any language compute the same partition
//! for a key, so this function and its test vectors must never change.

/// FNV-1a 64-bit offset basis.
pub const FNV_OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
/// FNV-1a 64-bit prime.
pub const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a 64-bit hash of `bytes`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut hash = FNV_OFFSET_BASIS;
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(FNV_PRIME);
    }
    hash
}

/// The partition of `key` among `partitions` partitions.
///
/// # Panics
/// Never for `partitions > 0`; `partitions == 0` is refused earlier, when a stream is
/// declared, and here returns partition 0 rather than dividing by zero.
pub fn partition_for(key: &str, partitions: u32) -> u32 {
    if partitions == 0 {
        return 0;
    }
    // The remainder is < partitions, which fits in u32.
    (fnv1a64(key.as_bytes()) % u64::from(partitions)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Published FNV-1a 64 vectors (from the FNV reference test suite).
    #[test]
    fn fnv1a64_matches_reference_vectors() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    /// Pinned key → partition pairs; docs/wire-format.md lists the same pairs.
    #[test]
    fn partition_vectors_are_pinned() {
        let cases: [(&str, u32, u64, u32); 7] = [
            ("order-1001", 8, 0x2e68_1292_c686_c08c, 4),
            ("", 8, 0xcbf2_9ce4_8422_2325, 5),
            ("a", 8, 0xaf63_dc4c_8601_ec8c, 4),
            ("42", 8, 0x07ee_7e07_b4b1_9223, 3),
            ("customer-17", 8, 0x1e2c_8170_eb27_5620, 0),
            ("foobar", 16, 0x8594_4171_f739_67e8, 8),
            ("42", 1, 0x07ee_7e07_b4b1_9223, 0),
        ];
        for (key, parts, hash, part) in cases {
            assert_eq!(fnv1a64(key.as_bytes()), hash, "hash of {key:?}");
            assert_eq!(partition_for(key, parts), part, "partition of {key:?} in {parts}");
        }
    }

    #[test]
    fn zero_partitions_does_not_panic() {
        assert_eq!(partition_for("x", 0), 0);
    }
}
