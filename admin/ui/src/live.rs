//! The live utilization stream (`/api/v1/live`, server-sent events): the
//! last minutes of one-second frames, shared by every page.

use std::collections::VecDeque;

use leptos::prelude::*;
pub use sluice_api::{LiveFrame as Frame, Utilization};
use wasm_bindgen::closure::Closure;
use wasm_bindgen::JsCast;

/// Frames kept in the browser: ten minutes.
const KEEP: usize = 600;

#[derive(Clone, Copy)]
pub struct LiveFrames(pub RwSignal<VecDeque<Frame>>);

impl LiveFrames {
    pub fn latest(&self) -> Option<Frame> {
        self.0.with(|f| f.back().cloned())
    }
}

/// Opens the stream once for the whole app; frames land in the signal.
pub fn connect() -> LiveFrames {
    let frames = LiveFrames(RwSignal::new(VecDeque::new()));
    let Ok(source) = web_sys::EventSource::new("/api/v1/live") else {
        return frames;
    };
    let signal = frames.0;
    let on_history =
        Closure::<dyn FnMut(web_sys::MessageEvent)>::new(move |ev: web_sys::MessageEvent| {
            if let Some(text) = ev.data().as_string() {
                if let Ok(history) = serde_json::from_str::<Vec<Frame>>(&text) {
                    signal.set(history.into_iter().collect());
                }
            }
        });
    let on_frame =
        Closure::<dyn FnMut(web_sys::MessageEvent)>::new(move |ev: web_sys::MessageEvent| {
            if let Some(text) = ev.data().as_string() {
                if let Ok(frame) = serde_json::from_str::<Frame>(&text) {
                    signal.update(|f| {
                        if f.len() >= KEEP {
                            f.pop_front();
                        }
                        f.push_back(frame);
                    });
                }
            }
        });
    let _ = source.add_event_listener_with_callback("history", on_history.as_ref().unchecked_ref());
    let _ = source.add_event_listener_with_callback("frame", on_frame.as_ref().unchecked_ref());
    // The stream lives as long as the page.
    on_history.forget();
    on_frame.forget();
    std::mem::forget(source);
    frames
}
