//! Lease ids: issued by this sidecar, 128 random bits in lower-case hex.
//!
//! They are capabilities: whoever shows one may keep the lease alive or release it, so they
//! are unguessable, and a lease of another sidecar (or of this one before a restart) is
//! simply unknown.

use std::fmt;

use rand::Rng;

/// A lease id.
/// Ordered only so that a table of wake-ups can break ties between equal deadlines.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LeaseId(u128);

impl LeaseId {
    /// A fresh random id.
    pub fn random() -> LeaseId {
        LeaseId(rand::rng().random())
    }

    /// Parses 32 lower-case hex digits; anything else is no lease of ours.
    pub fn parse(text: &str) -> Option<LeaseId> {
        if text.len() != 32
            || !text
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            return None;
        }
        u128::from_str_radix(text, 16).ok().map(LeaseId)
    }
}

impl fmt::Display for LeaseId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for LeaseId {
    // The id is a capability: debug output shows only its first digits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseId({:08x}…)", self.0 >> 96)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_differ() {
        let a = LeaseId::random();
        let b = LeaseId::random();
        assert_ne!(a, b);
        assert_eq!(a.to_string().len(), 32);
        assert_eq!(LeaseId::parse(&a.to_string()), Some(a));
        assert_eq!(LeaseId::parse(&LeaseId(0).to_string()), Some(LeaseId(0)));
    }

    #[test]
    fn anything_but_32_lower_hex_digits_is_unknown() {
        for bad in [
            "",
            "abc",
            &"A".repeat(32),
            &"g".repeat(32),
            &"0".repeat(33),
            "+0000000000000000000000000000000",
        ] {
            assert_eq!(LeaseId::parse(bad), None, "{bad}");
        }
    }
}
