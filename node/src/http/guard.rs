//! Who may ask the endpoint what: the `Host` a request names, and its token.
//!
//! **Host.** A request is served only when its `Host` (and an absolute request target's
//! authority) names this endpoint: the bound address (`ip:port`), `localhost:port` on a
//! loopback or unspecified bind, any IP literal with the bound port on an unspecified
//! bind (`0.0.0.0`, `::`), or a name given with `--http-host` (`name` for any port,
//! `name:port` for that port). A page that reaches the node through a name of its own
//! (DNS rebinding: `evil.example` resolving to 127.0.0.1) sends that name, so it is
//! refused (403); it cannot send an IP literal or `localhost` without being a page of
//! that origin, which the browser keeps apart from its own.
//!
//! **Token.** Sent as `Authorization: Bearer <token>` and compared in constant time.
//! Mutating calls (a replay) need it always, so a node without a token refuses them;
//! once a token is set, every read needs it too, except the page itself (it holds no
//! job data and reads the token from its URL fragment) and `/healthz`.

use axum::extract::{Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

/// Paths served to anyone (whose `Host` is ours): the page and its files, and the
/// health check. They hold no job data.
const PUBLIC: [&str; 4] = ["/", "/app.js", "/style.css", "/healthz"];

/// The hosts an endpoint answers to.
#[derive(Debug, Clone)]
pub struct AllowedHosts {
    bound: SocketAddr,
    /// Lowercase names, each with its port when one was given.
    names: Vec<(String, Option<u16>)>,
}

/// A `--http-host` value that is not a host name.
#[derive(Debug, thiserror::Error)]
#[error(
    "--http-host {0:?} is not a host name: give a name the node is reached by, as `name` (any port) or `name:port` (e.g. flotilla.internal or flotilla.internal:9090)"
)]
pub struct BadHostName(pub String);

impl AllowedHosts {
    /// The bound address and the names configured (`name` or `name:port`).
    ///
    /// # Errors
    /// [`BadHostName`] for a name with a scheme, a path, a bad port or nothing in it.
    pub fn new(bound: SocketAddr, names: &[String]) -> Result<Self, BadHostName> {
        let names = names
            .iter()
            .map(|n| split(n.trim()).ok_or_else(|| BadHostName(n.trim().into())))
            .collect::<Result<_, _>>()?;
        Ok(Self { bound, names })
    }

    /// Whether a request naming `host` (a `Host` header's value) is for this endpoint.
    pub fn allows(&self, host: &str) -> bool {
        let Some((name, port)) = split(host) else { return false };
        if self.names.iter().any(|(n, p)| *n == name && p.is_none_or(|p| Some(p) == port)) {
            return true;
        }
        // A Host without a port names port 80.
        if port.unwrap_or(80) != self.bound.port() {
            return false;
        }
        let ip = self.bound.ip();
        match name.parse::<IpAddr>() {
            Ok(asked) => asked == ip || ip.is_unspecified(),
            Err(_) => name == "localhost" && (ip.is_loopback() || ip.is_unspecified()),
        }
    }
}

/// `host[:port]` or `[v6]:port`, lowercased, or `None` when it is not one.
fn split(host: &str) -> Option<(String, Option<u16>)> {
    let (name, port) = if let Some(rest) = host.strip_prefix('[') {
        let (v6, after) = rest.split_once(']')?;
        v6.parse::<std::net::Ipv6Addr>().ok()?;
        match after {
            "" => (v6, None),
            _ => (v6, Some(after.strip_prefix(':')?)),
        }
    } else {
        match host.split_once(':') {
            Some((name, port)) => (name, Some(port)),
            None => (host, None),
        }
    };
    let port = match port {
        Some(p) if !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()) => Some(p.parse::<u16>().ok()?),
        Some(_) => return None,
        None => None,
    };
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | ':');
    (!name.is_empty() && name.chars().all(ok)).then(|| (name.to_ascii_lowercase(), port))
}

/// Whether `authorization` is `Bearer <token>` (the scheme in any case), compared in
/// time that does not depend on where the two differ.
pub fn bearer_matches(authorization: Option<&HeaderValue>, token: &str) -> bool {
    let Some(value) = authorization.map(HeaderValue::as_bytes) else { return false };
    let Some((scheme, sent)) = value.split_at_checked(7) else { return false };
    scheme.eq_ignore_ascii_case(b"bearer ") && constant_time_eq(sent, token.as_bytes())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    // The length is no secret worth hiding (the docs say how long tokens are); the
    // bytes are compared all the way through.
    if a.len() != b.len() {
        return false;
    }
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// What the endpoint checks each request against.
#[derive(Debug)]
pub struct Access {
    /// The hosts it answers to.
    pub hosts: AllowedHosts,
    /// The token, when one is set.
    pub token: Option<String>,
}

fn refuse(status: StatusCode, message: String) -> Response {
    let mut response = (status, axum::Json(serde_json::json!({ "error": message }))).into_response();
    if status == StatusCode::UNAUTHORIZED {
        response.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"flotilla\""));
    }
    response
}

/// The middleware: the host first, then the token.
pub async fn guard(State(access): State<Arc<Access>>, request: Request, next: Next) -> Response {
    let host = request.headers().get(header::HOST).map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned());
    let authority = request.uri().authority().map(|a| a.as_str().to_owned());
    let ours = host.as_deref().is_some_and(|h| access.hosts.allows(h))
        && authority.as_deref().is_none_or(|a| access.hosts.allows(a));
    if !ours {
        let named = host.or(authority).unwrap_or_default();
        return refuse(
            StatusCode::FORBIDDEN,
            format!(
                "host {named:?} is not served here: use the address the node listens on, or name this host with --http-host (http_hosts in the config file); requests naming other hosts are refused so that no web page can reach the node through a name of its own (DNS rebinding)"
            ),
        );
    }
    let mutating = !matches!(*request.method(), Method::GET | Method::HEAD);
    let public = !mutating && PUBLIC.contains(&request.uri().path());
    let sent = request.headers().get(header::AUTHORIZATION);
    match &access.token {
        None if mutating => refuse(
            StatusCode::UNAUTHORIZED,
            "replaying dead letters over HTTP needs a token: start the node with --http-token-file PATH (or --http-token, FLOTILLA_HTTP_TOKEN, http_token in the config file) and send it as `Authorization: Bearer <token>`; on the dashboard, open it as /#token=<token>".into(),
        ),
        Some(token) if !public && !bearer_matches(sent, token) => refuse(
            StatusCode::UNAUTHORIZED,
            "this node's endpoint needs its token (--http-token or --http-token-file): send it as `Authorization: Bearer <token>`; on the dashboard, open it as /#token=<token>".into(),
        ),
        _ => next.run(request).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(bound: &str, names: &[&str]) -> AllowedHosts {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        AllowedHosts::new(bound.parse().expect("addr"), &names).expect("names")
    }

    #[test]
    fn a_loopback_bind_answers_to_its_address_and_localhost_only() {
        let h = hosts("127.0.0.1:9090", &[]);
        for ok in ["127.0.0.1:9090", "localhost:9090", "LOCALHOST:9090"] {
            assert!(h.allows(ok), "{ok}");
        }
        for refused in [
            "evil.example:9090",
            "evil.example",
            "127.0.0.1",
            "127.0.0.1:9091",
            "127.0.0.2:9090",
            "localhost.evil.example:9090",
            "127.0.0.1.nip.io:9090",
            "[::1]:9090",
            "localhost:9090:1",
            "localhost:",
            "",
            "user@127.0.0.1:9090",
            "127.0.0.1:99999",
        ] {
            assert!(!h.allows(refused), "{refused:?}");
        }
    }

    #[test]
    fn an_unspecified_bind_answers_to_any_address_of_its_port_and_names_given() {
        let h = hosts("0.0.0.0:80", &["flotilla.internal", "dash.example:8443"]);
        for ok in [
            "10.1.2.3",
            "10.1.2.3:80",
            "localhost",
            "[::1]:80",
            "flotilla.internal",
            "Flotilla.Internal:9000",
            "dash.example:8443",
        ] {
            assert!(h.allows(ok), "{ok}");
        }
        for refused in ["10.1.2.3:81", "evil.example", "dash.example", "dash.example:443", "internal"] {
            assert!(!h.allows(refused), "{refused}");
        }
        let v6 = hosts("[::1]:9090", &[]);
        assert!(v6.allows("[::1]:9090") && v6.allows("localhost:9090") && !v6.allows("[::2]:9090"));
        for bad in ["http://x.example", "x.example/path", "x.example:port", "", "a b"] {
            assert!(AllowedHosts::new("127.0.0.1:1".parse().expect("addr"), &[bad.to_owned()]).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn only_the_exact_bearer_token_matches() {
        let token = "0123456789abcdef";
        let header = |v: &'static str| Some(HeaderValue::from_static(v));
        assert!(bearer_matches(header("Bearer 0123456789abcdef").as_ref(), token));
        assert!(bearer_matches(header("bearer 0123456789abcdef").as_ref(), token));
        for wrong in [
            "Bearer 0123456789abcde",
            "Bearer 0123456789abcdefg",
            "Bearer 0123456789abcdeF",
            "Bearer  0123456789abcdef",
            "Basic 0123456789abcdef",
            "0123456789abcdef",
            "Bearer",
            "",
        ] {
            assert!(!bearer_matches(header(wrong).as_ref(), token), "{wrong:?}");
        }
        assert!(!bearer_matches(None, token));
    }
}
