//! `POST /prices/import`: what importing a price catalog changed (or, dry,
//! would change) in the set's price table.

use serde::{Deserialize, Serialize};
use sluice_shared::price::ModelPrice;

/// A model's price, as the table holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PricedModel {
    pub model: String,
    pub price: ModelPrice,
}

/// A model whose price the catalog changes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PriceChange {
    pub model: String,
    pub before: ModelPrice,
    pub after: ModelPrice,
}

/// A catalog entry left out, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefusedModel {
    pub model: String,
    pub reason: String,
}

/// The import, entry by entry.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PricesImported {
    pub added: Vec<PricedModel>,
    pub changed: Vec<PriceChange>,
    /// Entries whose price the table already holds.
    pub unchanged: usize,
    /// Entries the filters left out (`only`, `provider`).
    pub not_selected: usize,
    pub refused: Vec<RefusedModel>,
    /// False for a dry run, or when nothing changed.
    pub applied: bool,
    /// The policy set's version afterwards.
    pub version: u64,
}
