//! A ledger in parts, as admin replicas keep it in Redis: its head (what
//! is no one instance's) and one record per member. A sync changes its
//! own member, the head, and forgets members whose reservations ended;
//! so a replica writes those parts only, and reads only the parts the
//! others wrote since it last looked, instead of the whole ledger each
//! way (at a thousand Envoys, 3.4 MB through Redis a sync).

use super::ledger::{Head, Ledger};
use super::member::Member;

impl Ledger {
    /// Its head, as a record.
    pub fn head_record(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string(&self.head)
    }

    /// Its head as `record` says.
    pub fn set_head_record(&mut self, record: &str) -> Result<(), serde_json::Error> {
        self.head = serde_json::from_str::<Head>(record)?;
        Ok(())
    }

    /// `instance`'s member, as a record; None when it has none.
    pub fn member_record(&self, instance: &str) -> Option<Result<String, serde_json::Error>> {
        self.members.get(instance).map(serde_json::to_string)
    }

    /// `instance`'s member as `record` says; None: it has none (it was
    /// forgotten).
    pub fn set_member_record(
        &mut self,
        instance: &str,
        record: Option<&str>,
    ) -> Result<(), serde_json::Error> {
        match record {
            Some(record) => {
                let member = serde_json::from_str::<Member>(record)?;
                self.members.insert(instance.to_string(), member);
            }
            None => {
                self.members.remove(instance);
            }
        }
        Ok(())
    }

    /// The members forgotten (their reservations ended) since this was
    /// last called, at most those of the last sync: parts to delete.
    pub fn take_forgotten(&mut self) -> Vec<String> {
        std::mem::take(&mut self.forgotten)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::{Demand, FleetTerms};
    use crate::time::{Instant, Span};

    const TERMS: FleetTerms = FleetTerms {
        limit: crate::fleet::Amount {
            rate: 100.0,
            in_flight: 10,
        },
        lease: Span::from_secs(2),
        floor_fraction: 0.05,
    };

    fn wants(rate: f64) -> Demand {
        Demand {
            rate,
            in_flight: 5,
            queued: 0,
            holds_no_slots: false,
        }
    }

    /// A ledger put back together from its parts is the ledger: the next
    /// sync gives the same share either way, and a forgotten member's
    /// part is named for deletion.
    #[test]
    fn a_ledger_from_its_parts_shares_as_the_whole_does() {
        let mut whole = Ledger::default();
        let t = Instant::from_millis;
        whole.sync(&TERMS, "gone", wants(50.0), None, t(0));
        let mut forgot = Vec::new();
        for at in (0..6_000).step_by(500) {
            whole.sync(&TERMS, "a", wants(80.0), None, t(at));
            forgot.extend(whole.take_forgotten());
            whole.sync(&TERMS, "b", wants(30.0), None, t(at + 1));
            forgot.extend(whole.take_forgotten());
        }
        assert_eq!(forgot, ["gone"], "named once, by the sync that forgot it");
        let mut parts = Ledger::default();
        parts
            .set_head_record(&whole.head_record().unwrap_or_else(|e| panic!("{e}")))
            .unwrap_or_else(|e| panic!("{e}"));
        for name in ["a", "b", "gone"] {
            let record = whole
                .member_record(name)
                .transpose()
                .unwrap_or_else(|e| panic!("{e}"));
            parts
                .set_member_record(name, record.as_deref())
                .unwrap_or_else(|e| panic!("{e}"));
        }
        let from_whole = whole.sync(&TERMS, "a", wants(90.0), None, t(6_100));
        let from_parts = parts.sync(&TERMS, "a", wants(90.0), None, t(6_100));
        assert_eq!(from_whole, from_parts);
        assert!(parts.member_record("gone").is_none());
        assert!(parts.set_member_record("x", Some("{not json")).is_err());
        assert!(parts.set_head_record(r#"{"lost": 3}"#).is_err());
    }
}
