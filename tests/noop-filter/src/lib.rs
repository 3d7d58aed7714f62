//! A proxy-wasm HTTP filter that lets every request through untouched. The
//! benchmark runs it to measure what merely entering a wasm filter costs,
//! the floor under any wasm filter's overhead, Sluice's included. Given a
//! header name as its configuration (plain text, e.g. `:authority`), it
//! also reads that header on every request: the floor of any filter that
//! decides by a request header.

#![forbid(unsafe_code)]

#[cfg(target_arch = "wasm32")]
mod noop {
    use std::rc::Rc;

    use proxy_wasm::hostcalls;
    use proxy_wasm::traits::{Context, HttpContext, RootContext};
    use proxy_wasm::types::{Action, ContextType, LogLevel, MapType};

    proxy_wasm::main! {{
        proxy_wasm::set_log_level(LogLevel::Warn);
        proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(NoopRoot::default()) });
    }}

    #[derive(Default)]
    struct NoopRoot {
        header: Option<Rc<str>>,
    }

    impl Context for NoopRoot {}

    impl RootContext for NoopRoot {
        fn on_configure(&mut self, _size: usize) -> bool {
            self.header = self
                .get_plugin_configuration()
                .and_then(|c| String::from_utf8(c).ok())
                .map(|c| c.trim().to_string())
                .filter(|c| !c.is_empty() && c != "{}")
                .map(Rc::from);
            true
        }

        fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
            Some(Box::new(Noop {
                header: self.header.clone(),
            }))
        }

        fn get_type(&self) -> Option<ContextType> {
            Some(ContextType::HttpContext)
        }
    }

    struct Noop {
        header: Option<Rc<str>>,
    }

    impl Context for Noop {}

    impl HttpContext for Noop {
        fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
            if let Some(name) = &self.header {
                let value = hostcalls::get_map_value_bytes(MapType::HttpRequestHeaders, name);
                std::hint::black_box(value.ok());
            }
            Action::Continue
        }
    }
}
