//! A real headless Chromium driven through ChromeDriver, for tests of web pages.
//!
//! [`Browser::start`] runs `/usr/bin/chromedriver` on a free loopback port, in a
//! process group of its own, and opens one W3C WebDriver session with
//! `/usr/bin/chromium --headless=new`. Every call is a blocking HTTP+JSON request to
//! ChromeDriver: call them from a plain thread or `tokio::task::spawn_blocking`, never
//! directly on an async runtime's worker.
//!
//! Dropping the [`Browser`] ends the session and kills ChromeDriver's whole process
//! group (ChromeDriver and every Chromium process it started), also when the test
//! panics. ChromeDriver's output goes to `chromedriver-<port>.log` in the screenshot
//! directory, next to the screenshots [`Browser::wait_for`] takes when it times out.
//!
//! Both programs come from Debian's `chromium` and `chromium-driver` packages; when
//! either is missing [`Browser::start`] fails with how to install them.

use std::fmt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::{SignalTarget, free_port, send_signal};

/// The ChromeDriver binary (Debian package `chromium-driver`).
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";
/// The Chromium binary (Debian package `chromium`).
const CHROMIUM: &str = "/usr/bin/chromium";
/// The key under which W3C WebDriver returns an element reference.
const ELEMENT_KEY: &str = "element-6066-11e4-a52e-4f735466cecf";
/// How long ChromeDriver may take to answer `/status` with `ready: true`.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// The longest any single WebDriver request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a navigation may take before ChromeDriver gives up on it.
const PAGE_LOAD_TIMEOUT_MS: u64 = 30_000;
/// How often [`Browser::wait_for`] checks.
const POLL_INTERVAL: Duration = Duration::from_millis(250);
/// The largest response body read (screenshots are base64 PNGs of a few MB).
const MAX_BODY: u64 = 64 * 1024 * 1024;

/// What went wrong talking to ChromeDriver or the page, as a readable message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebDriverError(pub String);

impl fmt::Display for WebDriverError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for WebDriverError {}

fn err(msg: impl Into<String>) -> WebDriverError {
    WebDriverError(msg.into())
}

/// The HTTP methods WebDriver commands use.
#[derive(Clone, Copy)]
enum Method {
    Get,
    Post,
}

/// A headless Chromium driven through ChromeDriver; both processes are killed on drop.
#[derive(Debug)]
pub struct Browser {
    child: Option<Child>,
    port: u16,
    session: Option<String>,
    agent: ureq::Agent,
    dir: PathBuf,
    log: PathBuf,
}

impl Browser {
    /// Starts ChromeDriver on a free loopback port (`--port=N`), waits until
    /// `GET /status` says it is ready (up to 20 s), and opens a session with a headless
    /// Chromium (`--headless=new --no-sandbox --disable-gpu --disable-dev-shm-usage
    /// --window-size=1400,1000`). Screenshots and ChromeDriver's log go to
    /// `screenshots`, which is created when missing.
    ///
    /// # Errors
    /// When ChromeDriver or Chromium is not installed (naming the Debian packages to
    /// install), when ChromeDriver exits or is not ready in time, or when the session
    /// cannot be created; the message includes the end of ChromeDriver's log.
    pub fn start(screenshots: &Path) -> Result<Browser, WebDriverError> {
        for (bin, package) in [(CHROMEDRIVER, "chromium-driver"), (CHROMIUM, "chromium")] {
            if !Path::new(bin).is_file() {
                return Err(err(format!(
                    "{bin} not found: install Chromium and ChromeDriver with \
                     `apt-get install -y chromium chromium-driver` (package {package} provides it). \
                     Browser tests need a real browser and never skip."
                )));
            }
        }
        std::fs::create_dir_all(screenshots)
            .map_err(|e| err(format!("cannot create screenshot directory {}: {e}", screenshots.display())))?;
        let port = free_port();
        let log = screenshots.join(format!("chromedriver-{port}.log"));
        let out = std::fs::File::create(&log).map_err(|e| err(format!("cannot create {}: {e}", log.display())))?;
        let out2 = out.try_clone().map_err(|e| err(format!("cannot share {}: {e}", log.display())))?;
        let child = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(out2)
            .process_group(0)
            .spawn()
            .map_err(|e| err(format!("cannot start {CHROMEDRIVER}: {e}")))?;
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_global(Some(REQUEST_TIMEOUT))
            .http_status_as_error(false)
            .proxy(None)
            .build()
            .into();
        // From here on, dropping `browser` (also on an early `?`) kills ChromeDriver.
        let mut browser =
            Browser { child: Some(child), port, session: None, agent, dir: screenshots.to_path_buf(), log };
        browser.wait_ready()?;
        browser.open_session()?;
        Ok(browser)
    }

    fn wait_ready(&mut self) -> Result<(), WebDriverError> {
        let start = Instant::now();
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(err(format!("chromedriver exited at start ({status}); {}", self.log_tail())));
            }
            let ready = self
                .agent
                .get(format!("{}/status", self.base()))
                .config()
                .timeout_global(Some(Duration::from_secs(2)))
                .build()
                .call()
                .ok()
                .and_then(|mut resp| resp.body_mut().read_json::<Value>().ok())
                .is_some_and(|status| status["value"]["ready"] == Value::Bool(true));
            if ready {
                return Ok(());
            }
            if start.elapsed() > READY_TIMEOUT {
                return Err(err(format!(
                    "chromedriver on port {} not ready after {READY_TIMEOUT:?}; {}",
                    self.port,
                    self.log_tail()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn open_session(&mut self) -> Result<(), WebDriverError> {
        let capabilities = json!({
            "capabilities": {
                "alwaysMatch": {
                    "browserName": "chrome",
                    "timeouts": { "pageLoad": PAGE_LOAD_TIMEOUT_MS },
                    "goog:chromeOptions": {
                        "binary": CHROMIUM,
                        "args": [
                            "--headless=new",
                            "--no-sandbox",
                            "--disable-gpu",
                            "--disable-dev-shm-usage",
                            "--window-size=1400,1000",
                        ],
                    },
                },
            },
        });
        let value = self
            .request(Method::Post, "/session", Some(capabilities))
            .map_err(|e| err(format!("cannot open a Chromium session: {e}; {}", self.log_tail())))?;
        let id =
            value["sessionId"].as_str().ok_or_else(|| err(format!("new session answer has no sessionId: {value}")))?;
        self.session = Some(id.to_owned());
        Ok(())
    }

    /// The last lines of ChromeDriver's log, for error messages.
    fn log_tail(&self) -> String {
        match std::fs::read_to_string(&self.log) {
            Ok(text) => {
                let lines: Vec<&str> = text.lines().collect();
                let tail = lines[lines.len().saturating_sub(40)..].join("\n");
                format!("chromedriver log ({}):\n{tail}", self.log.display())
            }
            Err(e) => format!("(no chromedriver log at {}: {e})", self.log.display()),
        }
    }

    fn base(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Sends one WebDriver command and returns the `value` of its answer.
    fn request(&self, method: Method, path: &str, body: Option<Value>) -> Result<Value, WebDriverError> {
        let url = format!("{}{path}", self.base());
        let name = match method {
            Method::Get => "GET",
            Method::Post => "POST",
        };
        let sent = match method {
            Method::Get => self.agent.get(&url).call(),
            Method::Post => self.agent.post(&url).send_json(body.unwrap_or_else(|| json!({}))),
        };
        let mut resp = sent.map_err(|e| err(format!("{name} {path}: {e}")))?;
        let status = resp.status();
        let mut answer: Value = resp
            .body_mut()
            .with_config()
            .limit(MAX_BODY)
            .read_json()
            .map_err(|e| err(format!("{name} {path}: HTTP {status}, unreadable answer: {e}")))?;
        let value = answer["value"].take();
        if !status.is_success() || value.get("error").is_some() {
            let error = value["error"].as_str().unwrap_or("unknown error");
            // Drop ChromeDriver's native stack trace: the first line says what happened.
            let message = value["message"].as_str().unwrap_or_default().lines().next().unwrap_or_default();
            // ChromeDriver's message usually starts with the error's name already.
            let what = if message.starts_with(error) { message.to_owned() } else { format!("{error}: {message}") };
            return Err(err(format!("{name} {path}: HTTP {status}, {what}")));
        }
        Ok(value)
    }

    /// A command under this session, `/session/{id}{path}`.
    fn command(&self, method: Method, path: &str, body: Option<Value>) -> Result<Value, WebDriverError> {
        let session = self.session.as_deref().ok_or_else(|| err("no WebDriver session"))?;
        self.request(method, &format!("/session/{session}{path}"), body)
    }

    /// Navigates to `url` and waits until the page has loaded (at most 30 s).
    ///
    /// # Errors
    /// When navigation fails or times out.
    pub fn goto(&self, url: &str) -> Result<(), WebDriverError> {
        self.command(Method::Post, "/url", Some(json!({ "url": url }))).map(drop)
    }

    /// The element references of every element matching the CSS selector `css`, in
    /// document order; empty when none does.
    ///
    /// # Errors
    /// When the selector is invalid or the command fails.
    pub fn find_all(&self, css: &str) -> Result<Vec<String>, WebDriverError> {
        let value = self.command(Method::Post, "/elements", Some(json!({ "using": "css selector", "value": css })))?;
        let items = value.as_array().ok_or_else(|| err(format!("find {css:?}: not a list: {value}")))?;
        items
            .iter()
            .map(|item| {
                item[ELEMENT_KEY]
                    .as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| err(format!("find {css:?}: not an element reference: {item}")))
            })
            .collect()
    }

    /// The rendered text of `element` (a reference from [`find_all`](Self::find_all)),
    /// as the user sees it: hidden elements have none.
    ///
    /// # Errors
    /// When the element is gone from the page ("stale element reference") or the
    /// command fails.
    pub fn text(&self, element: &str) -> Result<String, WebDriverError> {
        let value = self.command(Method::Get, &format!("/element/{}/text", segment(element)), None)?;
        value.as_str().map(str::to_owned).ok_or_else(|| err(format!("element text is not a string: {value}")))
    }

    /// The HTML attribute `name` of `element`, `None` when it has none.
    ///
    /// # Errors
    /// When the element is gone from the page or the command fails.
    pub fn attribute(&self, element: &str, name: &str) -> Result<Option<String>, WebDriverError> {
        let path = format!("/element/{}/attribute/{}", segment(element), segment(name));
        match self.command(Method::Get, &path, None)? {
            Value::Null => Ok(None),
            Value::String(s) => Ok(Some(s)),
            other => Ok(Some(other.to_string())),
        }
    }

    /// Clicks `element` as a user would, through WebDriver (scrolled into view, at its
    /// centre), not with a JavaScript `click()`.
    ///
    /// # Errors
    /// When the element is gone, hidden or covered by another element, or the command
    /// fails.
    pub fn click(&self, element: &str) -> Result<(), WebDriverError> {
        self.command(Method::Post, &format!("/element/{}/click", segment(element)), Some(json!({}))).map(drop)
    }

    /// Runs `script` as the body of a JavaScript function in the page and returns
    /// what it returns (`return document.title;`), `null` when it returns nothing.
    ///
    /// # Errors
    /// When the script throws or the command fails.
    pub fn eval(&self, script: &str) -> Result<Value, WebDriverError> {
        self.command(Method::Post, "/execute/sync", Some(json!({ "script": script, "args": [] })))
    }

    /// The text of every element matching `css`, in document order.
    ///
    /// # Errors
    /// As [`find_all`](Self::find_all) and [`text`](Self::text): an element that leaves
    /// the page between the two fails the call, so poll with
    /// [`wait_for`](Self::wait_for), which retries such failures.
    pub fn texts(&self, css: &str) -> Result<Vec<String>, WebDriverError> {
        self.find_all(css)?.iter().map(|element| self.text(element)).collect()
    }

    /// Calls `check` every 250 ms until it returns `Some`, and returns that.
    ///
    /// An error from `check` about an element that left or is not yet on the page
    /// ("stale element reference", "no such element") counts as "not yet"; any other
    /// error ends the wait at once.
    ///
    /// # Errors
    /// When `timeout` passes first: a screenshot `<what>-timeout.png` is saved and the
    /// error names `what` (and the last retried error, if any). Also any other error
    /// `check` returns.
    pub fn wait_for<T>(
        &self,
        what: &str,
        timeout: Duration,
        mut check: impl FnMut(&Browser) -> Result<Option<T>, WebDriverError>,
    ) -> Result<T, WebDriverError> {
        let start = Instant::now();
        loop {
            let retried = match check(self) {
                Ok(Some(found)) => return Ok(found),
                Ok(None) => None,
                Err(e) if is_transient(&e) => Some(e),
                Err(e) => return Err(err(format!("waiting for {what}: {e}"))),
            };
            if start.elapsed() >= timeout {
                let shot = match self.screenshot(&format!("{what}-timeout")) {
                    Ok(path) => format!("screenshot {}", path.display()),
                    Err(e) => format!("no screenshot: {e}"),
                };
                let last = retried.map(|e| format!("; last error: {e}")).unwrap_or_default();
                return Err(err(format!("timed out after {timeout:?} waiting for {what}{last} ({shot})")));
            }
            std::thread::sleep(POLL_INTERVAL);
        }
    }

    /// Saves a PNG of the visible page as `<dir>/<name>.png` (`dir` as given to
    /// [`start`](Self::start); `/` in `name` becomes `_`) and returns its path.
    ///
    /// # Errors
    /// When the screenshot cannot be taken, decoded or written.
    pub fn screenshot(&self, name: &str) -> Result<PathBuf, WebDriverError> {
        let value = self.command(Method::Get, "/screenshot", None)?;
        let encoded = value.as_str().ok_or_else(|| err("screenshot answer is not a string"))?;
        let png = decode_base64(encoded)?;
        let path = self.dir.join(format!("{}.png", name.replace(['/', '\\'], "_")));
        std::fs::write(&path, png).map_err(|e| err(format!("cannot write {}: {e}", path.display())))?;
        Ok(path)
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if let Some(session) = self.session.take() {
            let url = format!("{}/session/{session}", self.base());
            let _ = self.agent.delete(&url).config().timeout_global(Some(Duration::from_secs(5))).build().call();
        }
        if let Some(mut child) = self.child.take() {
            // ChromeDriver leads its own process group (process_group(0)), and the
            // Chromium processes it starts stay in it: kill them all at once.
            send_signal("KILL", SignalTarget::Group(child.id()));
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Whether a failed check may succeed later: the element left or is not yet on the page.
fn is_transient(e: &WebDriverError) -> bool {
    e.0.contains("stale element reference") || e.0.contains("no such element")
}

/// Percent-encodes `s` for use as one URL path segment.
fn segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Decodes standard base64 (`A–Z a–z 0–9 + /`, `=` padding); whitespace is skipped.
///
/// # Errors
/// On any other character, or a length that no base64 text has.
fn decode_base64(text: &str) -> Result<Vec<u8>, WebDriverError> {
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    let (mut bits, mut nbits, mut digits) = (0u32, 0u32, 0usize);
    let body = text.trim_end_matches(|c: char| c == '=' || c.is_ascii_whitespace());
    for c in body.bytes().filter(|c| !c.is_ascii_whitespace()) {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return Err(err(format!("invalid base64 character {:?}", char::from(c)))),
        };
        bits = (bits << 6) | u32::from(v);
        nbits += 6;
        digits += 1;
        if nbits >= 8 {
            nbits -= 8;
            out.push((bits >> nbits) as u8);
            bits &= (1 << nbits) - 1;
        }
    }
    if digits % 4 == 1 {
        return Err(err("invalid base64 length"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_decodes_every_padding() {
        assert_eq!(decode_base64("").unwrap(), b"");
        assert_eq!(decode_base64("Zg==").unwrap(), b"f");
        assert_eq!(decode_base64("Zm8=").unwrap(), b"fo");
        assert_eq!(decode_base64("Zm9v").unwrap(), b"foo");
        assert_eq!(decode_base64("Zm9vYmFy").unwrap(), b"foobar");
        assert_eq!(decode_base64("Zm9v\nYmE=").unwrap(), b"fooba");
        assert_eq!(decode_base64("iVBORw0KGgo=").unwrap(), b"\x89PNG\r\n\x1a\n");
        assert_eq!(decode_base64("+/+/").unwrap(), [0xfb, 0xff, 0xbf]);
    }

    #[test]
    fn base64_rejects_garbage() {
        assert!(decode_base64("Zm9v!").is_err());
        assert!(decode_base64("Zm9vY").is_err());
    }

    #[test]
    fn path_segments_are_percent_encoded() {
        assert_eq!(segment("f.99B.d.9D.e.2"), "f.99B.d.9D.e.2");
        assert_eq!(segment("data-x y/z"), "data-x%20y%2Fz");
    }
}
