// Loads the Leptos app (wasm-bindgen --target web output in /pkg).
import init from "/pkg/sluice_ui.js";
init({ module_or_path: "/pkg/sluice_ui_bg.wasm" });
