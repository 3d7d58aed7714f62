//! The Sluice admin web UI: log in, list and edit policies with the
//! server's validation inline, watch utilization live, read the audit log
//! and the Envoys seen. Client-side rendered with Leptos; every value shown
//! goes through Leptos text nodes, so policy content is never HTML.

#![forbid(unsafe_code)]

pub mod fields;
pub mod form;
pub mod pool_view;
pub mod spend_text;

#[cfg(target_arch = "wasm32")]
mod api;
#[cfg(target_arch = "wasm32")]
mod budget_tree;
#[cfg(target_arch = "wasm32")]
mod budgets;
#[cfg(target_arch = "wasm32")]
mod fair_keys;
#[cfg(target_arch = "wasm32")]
mod keys;
#[cfg(target_arch = "wasm32")]
mod live;
#[cfg(target_arch = "wasm32")]
mod pages;
#[cfg(target_arch = "wasm32")]
mod people;
#[cfg(target_arch = "wasm32")]
mod pools;
#[cfg(target_arch = "wasm32")]
mod session;
#[cfg(target_arch = "wasm32")]
mod spend_bar;

#[cfg(target_arch = "wasm32")]
#[wasm_bindgen::prelude::wasm_bindgen(start)]
pub fn start() {
    console_error_panic_hook::set_once();
    leptos::mount::mount_to_body(pages::App);
}
