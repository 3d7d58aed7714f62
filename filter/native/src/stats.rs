//! Stats through Envoy's dynamic-module metrics. Envoy takes a module's
//! stat definitions only while the filter is configured, before any
//! policy is known, so each stat of a family ([`StatFamily`]) is defined
//! then as one stat labelled by its policy or limit:
//! `sluice_policy_<stat>` with the label `sluice_policy`. Prometheus then
//! shows the same series as the wasm filter's (with the tag extractors of
//! our Envoy configs): `sluice_policy_admitted{sluice_policy="bank"}`;
//! `/stats` names them `wasmcustom.sluice_policy_admitted.sluice_policy.bank`.
//! The filter's own stats are defined one by one, under their names.

use std::sync::Mutex;

use rustc_hash::FxHashMap;
use sluice_filter::metrics::{family_stats, filter_stats, StatFamily};

use crate::abi::{self, EnvoyPtr, ModuleBuffer, METRICS_SUCCESS};

/// A stat the worker defined: Envoy's id and, for a family's, its label
/// value.
#[derive(Debug)]
struct Defined {
    id: usize,
    gauge: bool,
    label: Option<String>,
}

#[derive(Debug, Default)]
pub struct Stats {
    /// Each family stat, by (family, stat): Envoy's id, whether a gauge.
    families: FxHashMap<(&'static str, &'static str), (usize, bool)>,
    /// The filter's own stats by full name: Envoy's id, whether a gauge.
    filter: FxHashMap<String, (usize, bool)>,
    /// Indexed by the id the worker was given.
    defined: Mutex<Vec<Defined>>,
}

/// Defines one stat with Envoy; its id.
///
/// # Safety
/// `config` must be the configuration Envoy is creating.
unsafe fn define_one(
    config: EnvoyPtr,
    name: &str,
    label: Option<&str>,
    gauge: bool,
) -> Option<usize> {
    let labels: Vec<ModuleBuffer> = label
        .map(|l| ModuleBuffer::of(l.as_bytes()))
        .into_iter()
        .collect();
    let labels_ptr = if labels.is_empty() {
        std::ptr::null()
    } else {
        labels.as_ptr()
    };
    let mut id = 0usize;
    let name = ModuleBuffer::of(name.as_bytes());
    // SAFETY: the caller's promise; name and labels live through the call.
    let result = unsafe {
        if gauge {
            abi::envoy_dynamic_module_callback_http_filter_config_define_gauge(
                config,
                name,
                labels_ptr,
                labels.len(),
                &mut id,
            )
        } else {
            abi::envoy_dynamic_module_callback_http_filter_config_define_counter(
                config,
                name,
                labels_ptr,
                labels.len(),
                &mut id,
            )
        }
    };
    (result == METRICS_SUCCESS).then_some(id)
}

impl Stats {
    /// Defines every stat with Envoy; only while the filter is configured.
    ///
    /// # Safety
    /// `config` must be the configuration Envoy is creating.
    pub unsafe fn define_all(config: EnvoyPtr) -> Self {
        let mut stats = Self::default();
        for (family, stat, gauge) in family_stats() {
            let name = format!("sluice_{family}_{stat}");
            let label = format!("sluice_{family}");
            // SAFETY: the caller's promise.
            if let Some(id) = unsafe { define_one(config, &name, Some(&label), gauge) } {
                stats.families.insert((family, stat), (id, gauge));
            }
        }
        for (name, gauge) in filter_stats() {
            // SAFETY: the caller's promise.
            if let Some(id) = unsafe { define_one(config, &name, None, gauge) } {
                stats.filter.insert(name, (id, gauge));
            }
        }
        stats
    }

    /// The worker's id for `name`; None when it falls in no family defined.
    pub fn define(&self, name: &str, gauge: bool) -> Option<u32> {
        let defined = match StatFamily::of(name)? {
            StatFamily::Labelled {
                family,
                owner,
                stat,
            } => {
                let &(id, is_gauge) = self.families.get(&(family, stat))?;
                Defined {
                    id,
                    gauge: is_gauge || gauge,
                    label: Some(owner.to_string()),
                }
            }
            StatFamily::Filter => {
                let &(id, is_gauge) = self.filter.get(name)?;
                Defined {
                    id,
                    gauge: is_gauge,
                    label: None,
                }
            }
        };
        let mut all = self.defined.lock().unwrap_or_else(|e| e.into_inner());
        all.push(defined);
        u32::try_from(all.len() - 1).ok()
    }

    /// Makes stat `id` show (at 0) before it first counts, as a wasm
    /// filter's defined stats do: Envoy makes a labelled stat when it is
    /// first added to.
    ///
    /// # Safety
    /// As [`Stats::add`].
    pub unsafe fn show(&self, config: EnvoyPtr, id: u32) {
        // SAFETY: the caller's promise.
        unsafe { self.add(config, id, 0) };
    }

    /// Adds `delta` to stat `id`.
    ///
    /// # Safety
    /// `config` must be the live configuration the stats were defined in.
    pub unsafe fn add(&self, config: EnvoyPtr, id: u32, delta: i64) {
        let all = self.defined.lock().unwrap_or_else(|e| e.into_inner());
        let Some(d) = usize::try_from(id).ok().and_then(|i| all.get(i)) else {
            return;
        };
        let label = d.label.as_deref().map(|l| [ModuleBuffer::of(l.as_bytes())]);
        let (labels, labels_len) = match &label {
            Some(l) => (l.as_ptr(), 1),
            None => (std::ptr::null(), 0),
        };
        let amount = delta.unsigned_abs();
        // SAFETY: the config is live; the label lives through the call.
        unsafe {
            match (d.gauge, delta >= 0) {
                (false, true) => {
                    abi::envoy_dynamic_module_callback_http_filter_config_increment_counter(
                        config, d.id, labels, labels_len, amount,
                    );
                }
                // A counter never goes down.
                (false, false) => {}
                (true, true) => {
                    abi::envoy_dynamic_module_callback_http_filter_config_increment_gauge(
                        config, d.id, labels, labels_len, amount,
                    );
                }
                (true, false) => {
                    abi::envoy_dynamic_module_callback_http_filter_config_decrement_gauge(
                        config, d.id, labels, labels_len, amount,
                    );
                }
            }
        }
    }
}
