//! The demo `make run` starts, in pieces the end-to-end tests reuse:
//!
//! - [`mock`]: a third-party API with limits of its own, which counts
//!   every call it would have refused (the demo's API and the tests'
//!   provider);
//! - [`llm`]: an LLM-like provider (requests and tokens per key, usage in
//!   the answer or its last streamed event), which counts what it would
//!   bill and refuse;
//! - [`provider`], [`sliding`]: providers with hidden limits (calls per
//!   calendar second; tokens per key in a sliding window) speaking their
//!   count in headers;
//! - [`mcp`]: an MCP server (Streamable HTTP) whose tools count the calls
//!   they answer, per tool and per agent;
//! - [`tokens`]: how it counts a prompt's tokens (OpenAI's tokenizer);
//! - [`load`]: the demo's load generator, a little over each limit.
//!
//! The launcher itself is `src/bin/sluice-demo.rs`.

#![forbid(unsafe_code)]

pub mod llm;
pub mod load;
pub mod mcp;
pub mod mock;
pub mod provider;
pub mod sliding;
pub mod tokens;
