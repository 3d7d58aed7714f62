//! The set's price table: read, replaced, or merged with a price
//! catalog, each change checked with every policy (a money limit needs
//! prices).

use sluice_api::prices::PricesImported;
use sluice_shared::price::PriceTable;
use sluice_shared::validate::validate_policy_set;
use sluice_shared::{FieldError, Policy, PolicySet, ValidationErrors};

use super::{bump, list, prices, set_version, write_prices, BlockingStore};
use crate::price_catalog::{self, Catalog};
use crate::store::{now_ms, StoreError};

impl BlockingStore {
    /// The set's price table, if it has one.
    pub fn prices(&self) -> Result<Option<PriceTable>, StoreError> {
        self.db.read(prices)
    }

    /// Makes `table` the set's prices (None: none), checked with every
    /// policy (a money limit needs prices); the set's new version, or its
    /// version as it was when nothing changes.
    pub fn set_prices(&self, table: Option<PriceTable>, actor: &str) -> Result<u64, StoreError> {
        self.db.write(|sql| {
            let old = prices(sql)?;
            if old == table {
                return set_version(sql);
            }
            let all: Vec<Policy> = list(sql)?.into_iter().map(|s| s.policy).collect();
            validate_policy_set(&PolicySet {
                version: 1,
                prices: table.clone(),
                policies: all,
            })
            .map_err(StoreError::Invalid)?;
            let at = now_ms();
            let version = bump(sql)?;
            write_prices(sql, old.as_ref(), table.as_ref(), at, actor)?;
            Ok(version)
        })
    }

    /// Merges a price catalog's entries into the set's prices, checked
    /// with every policy as [`Self::set_prices`] checks a table; with
    /// `dry_run`, only says what would change.
    pub fn import_prices(
        &self,
        catalog: &Catalog,
        actor: &str,
        dry_run: bool,
    ) -> Result<PricesImported, StoreError> {
        self.db.write(|sql| {
            let old = prices(sql)?;
            let (table, mut imported) =
                price_catalog::merge(old.as_ref(), catalog).map_err(|e| {
                    StoreError::Invalid(ValidationErrors {
                        errors: vec![FieldError {
                            path: "prices.currency".into(),
                            message: e.to_string(),
                        }],
                    })
                })?;
            let changes = !imported.added.is_empty() || !imported.changed.is_empty();
            if changes {
                let all: Vec<Policy> = list(sql)?.into_iter().map(|s| s.policy).collect();
                validate_policy_set(&PolicySet {
                    version: 1,
                    prices: Some(table.clone()),
                    policies: all,
                })
                .map_err(StoreError::Invalid)?;
            }
            if dry_run || !changes {
                imported.version = set_version(sql)?;
                return Ok(imported);
            }
            imported.version = bump(sql)?;
            write_prices(sql, old.as_ref(), Some(&table), now_ms(), actor)?;
            imported.applied = true;
            Ok(imported)
        })
    }
}
