//! What a policy's calls cost in money: its money limits (its pool
//! members' with them), the call's prices and the model it names.

use sluice_shared::json_path::JsonPath;
use sluice_shared::request_headers::RequestHeaders;
use sluice_shared::usage::CompiledUsage;

use super::CompiledPolicy;
use crate::body::BodyJson;
use crate::matcher::CompiledLimit;
use crate::pricing::{CallPrice, CompiledPriceCost};

impl CompiledPolicy {
    /// The currency of its money limits, when it has any.
    pub fn currency(&self) -> Option<&str> {
        self.pricing.as_ref().map(|p| p.prices.currency.as_str())
    }

    /// Its money limits, its pool members' with them (a pool call is
    /// priced before its member is chosen).
    pub(crate) fn money_limits(&self) -> impl Iterator<Item = &CompiledPriceCost> {
        self.limits_and_members().filter_map(CompiledLimit::price)
    }

    /// The call's prices (its model's, by where the policy's money limits
    /// say it is named, and its unread ceiling; an MCP policy's, its
    /// tools'), for its money limits; None when the policy has none, or
    /// the model (a tool) has no price and the table no default.
    pub fn call_price<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        body: &BodyJson,
    ) -> Option<CallPrice> {
        let pricing = self.pricing.as_ref()?;
        match &self.mcp {
            Some(mcp) => pricing.tools_price(mcp, body),
            None => pricing.call_price(req, body, self.money_limits()),
        }
    }

    /// The model a call names and where in its JSON body, for a downgrade to rewrite.
    pub fn body_model<R: RequestHeaders + ?Sized>(
        &self,
        req: &R,
        body: &BodyJson,
    ) -> Option<(String, &JsonPath)> {
        let pricing = self.pricing.as_ref()?;
        let path = pricing.model_json()?;
        Some((pricing.model_named(req, body)?, path))
    }

    /// What a call of `price` is charged by the limit at `index` once its
    /// answer is in: a money limit's usage at the call's model's prices
    /// (or its answer's, when dearer; None for an unpriced call, which was
    /// refused), any other limit's own.
    pub fn priced_usage(&self, index: usize, price: Option<&CallPrice>) -> Option<CompiledUsage> {
        self.limits
            .get(index)?
            .priced_usage(price, self.pricing.as_ref())
    }
}
