//! The one hash of the house: FNV-1a 64 (the `fnv` crate) over a key's parts, each pair
//! separated by one 0x00 byte. Lease buckets (`tenant`), publisher shards (`tenant 0x00 run
//! 0x00 branch`) and partitions (`tenant 0x00 run`, part of the wire contract: broker/WIRE.md)
//! all take it modulo their count, so a host or consumer in another language computes the same
//! numbers from the same bytes.
use std::hash::Hasher;

/// FNV-1a 64 over `parts` joined by 0x00.
pub fn fnv1a(parts: &[&str]) -> u64 {
    let mut hasher = fnv::FnvHasher::default();
    for (at, part) in parts.iter().enumerate() {
        if at > 0 {
            hasher.write(&[0]);
        }
        hasher.write(part.as_bytes());
    }
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference vectors (the FNV authors' `""` and `"a"`), and the separator, against
    /// values computed independently (Python, byte by byte).
    #[test]
    fn fnv1a_is_the_reference_hash_over_parts_joined_by_zero() {
        assert_eq!(fnv1a(&[]), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(&[""]), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(&["a"]), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(&["a", "b"]), 0xe5d2_9919_0426_66b2);
        assert_eq!(fnv1a(&["t", "r", "main"]), 0x305d_462f_59d5_f412);
    }
}
