//! A request's headers as a shell reads them from Envoy: lazily, each at
//! most once however many policies look at it (a host call costs far more
//! than a copy), kept for a decision made once the body is in (the host
//! answers header reads only while the headers pass). A value read is
//! kept in a cell that is set once and lent out from there, never copied.

use std::cell::OnceCell;

/// Every policy's match reads it first: kept without a copy of its name.
const AUTHORITY: &str = ":authority";

/// Distinct headers kept per allocation besides `:authority` (a policy
/// often reads a key, a cost and a priority).
const HEADERS_KEPT: usize = 3;

/// A header's name and its value (None: absent), each set once.
type KeptHeader = (OnceCell<String>, OnceCell<Option<Vec<u8>>>);

#[derive(Default)]
pub struct KeptHeaders {
    authority: OnceCell<Option<Vec<u8>>>,
    /// Most policies read no other header: the cells for others are made
    /// on first use, not for every stream.
    others: OnceCell<Box<Slots>>,
}

/// A few headers at a time, more made on first use.
#[derive(Default)]
struct Slots {
    slots: [KeptHeader; HEADERS_KEPT],
    more: OnceCell<Box<Slots>>,
}

impl KeptHeaders {
    /// `name`'s value, read with `read` the first time it is asked for.
    pub fn value(&self, name: &str, read: impl FnOnce(&str) -> Option<Vec<u8>>) -> Option<&[u8]> {
        if name == AUTHORITY {
            return self.authority.get_or_init(|| read(AUTHORITY)).as_deref();
        }
        self.others.get_or_init(Default::default).value(name, read)
    }
}

impl Slots {
    fn value(&self, name: &str, read: impl FnOnce(&str) -> Option<Vec<u8>>) -> Option<&[u8]> {
        for (kept_name, value) in &self.slots {
            match kept_name.get() {
                Some(n) if n == name => return value.get().and_then(Option::as_deref),
                Some(_) => continue,
                None => {
                    let _ = kept_name.set(name.to_string());
                    return value.get_or_init(|| read(name)).as_deref();
                }
            }
        }
        self.more.get_or_init(Default::default).value(name, read)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    #[test]
    fn each_header_is_read_once_however_often_asked() {
        let kept = KeptHeaders::default();
        let reads = Cell::new(0);
        let read = |name: &str| {
            reads.set(reads.get() + 1);
            (name != "absent").then(|| name.as_bytes().to_vec())
        };
        for _ in 0..3 {
            for name in [":authority", "a", "b", "c", "d", "e", "absent"] {
                let want = (name != "absent").then_some(name.as_bytes());
                assert_eq!(kept.value(name, read), want);
            }
        }
        assert_eq!(reads.get(), 7);
    }
}
