//! A real headless Chromium (Debian's `chromium` and `chromium-driver`,
//! installed by `make setup`) driven over WebDriver.

use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use fantoccini::{Client, ClientBuilder, Locator};
use hyper_util::client::legacy::connect::HttpConnector;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use crate::envoy::free_port;

pub struct Browser {
    pub client: Client,
    driver: Child,
    /// Set once stopped: the group's id may then belong to someone else.
    stopped: bool,
    /// Chromium's and chromedriver's TMPDIR, removed once they are
    /// stopped: killed, Chromium leaves its profile and singleton
    /// directories behind (hundreds of `org.chromium.Chromium.*` in /tmp
    /// after a few runs of the suites).
    _scratch: tempfile::TempDir,
}

impl Browser {
    /// Logs in to the admin at `base` with the test password, then opens
    /// `page` (`/live`; "" stays on the policies).
    pub async fn log_in(&self, base: &str, page: &str) -> anyhow::Result<()> {
        self.client.goto(base).await?;
        self.fill("#password", crate::admin::PASSWORD).await?;
        self.click("#login-button").await?;
        self.text("#policies").await?;
        if !page.is_empty() {
            self.client.goto(&format!("{base}{page}")).await?;
        }
        Ok(())
    }

    pub async fn start() -> anyhow::Result<Self> {
        let port = free_port()?;
        let scratch = tempfile::tempdir().context("a scratch directory for Chromium")?;
        let mut driver = Command::new(
            std::env::var("CHROMEDRIVER").unwrap_or_else(|_| "/usr/bin/chromedriver".into()),
        )
        .arg(format!("--port={port}"))
        .env("TMPDIR", scratch.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // A group of its own, with the Chromium it starts: a test that
        // fails before closing its session stops them all (killing only
        // chromedriver left Chromium running).
        .process_group(0)
        .spawn()
        .context("starting chromedriver (make setup installs chromium-driver)")?;
        let url = format!("http://127.0.0.1:{port}");
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            serde_json::json!({
                "binary": std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into()),
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"]
            }),
        );
        let deadline = Instant::now() + Duration::from_secs(15);
        let client = loop {
            match ClientBuilder::new(HttpConnector::new())
                .capabilities(caps.clone())
                .connect(&url)
                .await
            {
                Ok(c) => break c,
                Err(e) if Instant::now() > deadline => {
                    stop_group(&mut driver);
                    bail!("no WebDriver session: {e}")
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        };
        Ok(Self {
            client,
            driver,
            stopped: false,
            _scratch: scratch,
        })
    }

    /// Waits (up to 10 s) for an element to be on the page.
    async fn element(&self, css: &str) -> anyhow::Result<fantoccini::elements::Element> {
        self.client
            .wait()
            .at_most(Duration::from_secs(10))
            .for_element(Locator::Css(css))
            .await
            .with_context(|| format!("no {css} on the page"))
    }

    /// Waits (up to 10 s) for an element and returns its text.
    /// A live view re-renders its rows every second: an element found just
    /// before a render is gone when its text is asked, and is found again.
    pub async fn text(&self, css: &str) -> anyhow::Result<String> {
        const ATTEMPTS: u32 = 5;
        let mut attempt = 1;
        loop {
            let el = self.element(css).await?;
            match el.text().await {
                Ok(text) => return Ok(text),
                Err(e) if e.is_stale_element_reference() && attempt < ATTEMPTS => attempt += 1,
                Err(e) => return Err(e).with_context(|| format!("the text of {css}")),
            }
        }
    }

    /// The text of each cell of each row `css` finds, as the page has it
    /// now (no rows: none yet). Read in one script, so the rows are one
    /// render's: read cell by cell over WebDriver, a live view's render
    /// between finding a row and asking its cells' text made the cells
    /// stale and the read fail (CI, stop 47).
    pub async fn table_rows(&self, css: &str) -> anyhow::Result<Vec<Vec<String>>> {
        self.read_all(
            css,
            "els.map(row => Array.from(row.querySelectorAll('td')).map(td => td.innerText.trim()))",
        )
        .await
    }

    /// The text of each element `css` finds, read in one script (one
    /// render's, as `table_rows`). `textContent`: SVG text has no
    /// `innerText`.
    pub async fn texts(&self, css: &str) -> anyhow::Result<Vec<String>> {
        self.read_all(css, "els.map(el => el.textContent.trim())")
            .await
    }

    /// `map` (a JavaScript expression of `els`, the elements `css` finds)
    /// evaluated in the page in one script.
    async fn read_all<T: serde::de::DeserializeOwned>(
        &self,
        css: &str,
        map: &str,
    ) -> anyhow::Result<T> {
        let script = format!(
            "const els = Array.from(document.querySelectorAll(arguments[0])); return {map};"
        );
        let read = self
            .client
            .execute(&script, vec![serde_json::Value::from(css)])
            .await
            .with_context(|| format!("reading {css}"))?;
        serde_json::from_value(read).with_context(|| format!("what was read of {css}"))
    }

    /// Waits until `css`'s text satisfies `pred`; returns the text.
    pub async fn wait_text(
        &self,
        css: &str,
        limit: Duration,
        pred: impl Fn(&str) -> bool,
    ) -> anyhow::Result<String> {
        let deadline = Instant::now() + limit;
        let mut last = String::new();
        while Instant::now() < deadline {
            if let Ok(els) = self.client.find_all(Locator::Css(css)).await {
                for el in els {
                    if let Ok(t) = el.text().await {
                        if pred(&t) {
                            return Ok(t);
                        }
                        last = t;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let page = match self.client.find(Locator::Css("body")).await {
            Ok(body) => body.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        };
        bail!("{css}: text never matched (last: {last:?}); the page says:\n{page}")
    }

    /// Waits until input `css`'s value equals `want`; returns the last value seen.
    pub async fn wait_value(
        &self,
        css: &str,
        want: &str,
        limit: Duration,
    ) -> anyhow::Result<Option<String>> {
        let deadline = Instant::now() + limit;
        let mut last = None;
        while Instant::now() < deadline {
            if let Ok(el) = self.client.find(Locator::Css(css)).await {
                last = el.prop("value").await.ok().flatten();
                if last.as_deref() == Some(want) {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(last)
    }

    /// Replaces an input's value and leaves the field, as a person would
    /// (the form reacts on change).
    pub async fn fill(&self, css: &str, value: &str) -> anyhow::Result<()> {
        let el = self.element(css).await?;
        el.clear().await?;
        el.send_keys(&format!("{value}\u{e004}")).await?;
        Ok(())
    }

    /// Types into an input without leaving it (the form checks as you
    /// type).
    pub async fn type_text(&self, css: &str, value: &str) -> anyhow::Result<()> {
        let el = self.element(css).await?;
        el.clear().await?;
        el.send_keys(value).await?;
        Ok(())
    }

    /// Picks the option `value` of the select `css` ("" for the empty
    /// one), as a person would: the select reacts on change.
    pub async fn choose(&self, css: &str, value: &str) -> anyhow::Result<()> {
        let el = self.element(css).await?;
        el.select_by_value(value)
            .await
            .with_context(|| format!("{css}: no option {value:?}"))?;
        Ok(())
    }

    pub async fn click(&self, css: &str) -> anyhow::Result<()> {
        let el = self.element(css).await?;
        el.click().await?;
        Ok(())
    }

    pub async fn close(mut self) {
        let _ = self.client.clone().close().await;
        self.stop();
    }

    /// Stops chromedriver and every browser process it started.
    fn stop(&mut self) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        stop_group(&mut self.driver);
    }
}

/// Stops chromedriver and every browser process it started (its process
/// group).
fn stop_group(driver: &mut Child) {
    if let Ok(pid) = i32::try_from(driver.id()) {
        let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
    }
    let _ = driver.kill();
    let _ = driver.wait();
}

impl Drop for Browser {
    fn drop(&mut self) {
        self.stop();
    }
}
