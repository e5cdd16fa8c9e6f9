//! Node configuration: a TOML file, `FLOTILLA_*` environment variables and flags.
//!
//! **Precedence**, highest first: command-line flags, then `FLOTILLA_*` environment
//! variables, then the config file (`--config PATH` or `FLOTILLA_CONFIG`), then the
//! defaults. Every setting can come from any of the three:
//!
//! ```toml
//! nats = ["nats://10.0.0.1:4222", "nats://10.0.0.2:4222"]   # or one string
//! node_id = "node-a"
//! log = "info,flotilla_actors=debug,flotilla_node=debug"
//! log_json = false
//! replicas = 3                   # copies of every stream and bucket (a NATS cluster of 3+)
//! http = "127.0.0.1:9090"        # serve /metrics, /api/status and the dashboard here
//! http_token_file = "/etc/flotilla/http-token"  # or http_token = "…": replays need it, and
//!                                # every read but the page and /healthz once it is set
//! http_hosts = ["flotilla.internal"]  # names it answers to besides its address
//! otlp_endpoint = "http://127.0.0.1:4318"   # export spans (a binary built with feature otlp)
//!
//! [connect]
//! user = "flotilla"
//! password = "secret"            # or: token = "…", credentials = "/etc/nats/app.creds",
//! tls_ca = "/etc/nats/ca.pem"    #     nkey_seed = "SU…", tls_cert + tls_key for mutual TLS
//! ping_interval = "3s"
//! connect_timeout = "5s"
//! request_timeout = "5s"
//!
//! [cluster]
//! lease_ttl = "6s"               # a dead node's partitions move within about this long
//! settle = "2s"                  # membership must be stable this long before partitions move
//! max_moves = 2                  # partitions a node hands over per step
//! ```
//!
//! A file with an unknown key or a bad value is refused with the key and its line.

use flotilla_transport::JetStreamOptions;
use serde::{Deserialize, Deserializer, Serialize};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Why the configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {reason}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        reason: String,
    },
    /// The file is not valid: unknown key, wrong type or bad value (the message names
    /// the key and shows its line).
    #[error("invalid config file {path}: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// TOML's report, with line and column.
        message: String,
    },
    /// A value given as a flag or environment variable is not valid.
    #[error("invalid {setting}: {problem}")]
    Value {
        /// The flag or variable.
        setting: String,
        /// What is wrong.
        problem: String,
    },
}

/// One URL or several.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(untagged)]
pub enum Urls {
    /// `nats = "nats://h:4222"` (commas separate several).
    One(String),
    /// `nats = ["nats://a:4222", "nats://b:4222"]`.
    Many(Vec<String>),
}

impl Urls {
    /// The URLs as a list.
    pub fn to_vec(&self) -> Vec<String> {
        match self {
            Urls::One(s) => split_urls(s),
            Urls::Many(v) => v.iter().flat_map(|s| split_urls(s)).collect(),
        }
    }
}

/// Splits a comma-separated URL list, dropping empty entries.
pub fn split_urls(s: &str) -> Vec<String> {
    s.split(',').map(str::trim).filter(|u| !u.is_empty()).map(str::to_owned).collect()
}

fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let text = Option::<String>::deserialize(d)?;
    text.map(|s| parse_duration(&s).map_err(serde::de::Error::custom)).transpose()
}

/// Parses `5s`, `500ms`, `2m` and the like.
///
/// # Errors
/// A message that shows the accepted form.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s.trim()).map_err(|e| format!("invalid duration {s:?} ({e}); write e.g. 5s, 500ms or 2m"))
}

/// How to authenticate and secure the NATS connection.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ConnectConfig {
    /// User name (with `password`).
    pub user: Option<String>,
    /// Password (with `user`).
    pub password: Option<String>,
    /// An auth token.
    pub token: Option<String>,
    /// A `.creds` file (JWT and nkey seed).
    pub credentials: Option<PathBuf>,
    /// An nkey seed.
    pub nkey_seed: Option<String>,
    /// A CA certificate (PEM) to trust.
    pub tls_ca: Option<PathBuf>,
    /// A client certificate (PEM), with `tls_key`.
    pub tls_cert: Option<PathBuf>,
    /// The client certificate's key (PEM), with `tls_cert`.
    pub tls_key: Option<PathBuf>,
    /// How often to ping the server.
    #[serde(default, deserialize_with = "duration", serialize_with = "ser_duration")]
    pub ping_interval: Option<Duration>,
    /// How long one connection attempt may take.
    #[serde(default, deserialize_with = "duration", serialize_with = "ser_duration")]
    pub connect_timeout: Option<Duration>,
    /// How long a JetStream API request may take.
    #[serde(default, deserialize_with = "duration", serialize_with = "ser_duration")]
    pub request_timeout: Option<Duration>,
}

fn ser_duration<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_str(&humantime::format_duration(*d).to_string()),
        None => s.serialize_none(),
    }
}

/// How a node takes part in its cluster (JetStream only).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSettings {
    /// A partition lease (and a node's membership) expires this long after its last
    /// renewal; default 6s.
    #[serde(default, deserialize_with = "duration", serialize_with = "ser_duration")]
    pub lease_ttl: Option<Duration>,
    /// Membership must be stable this long before partitions move between live nodes;
    /// default 2s.
    #[serde(default, deserialize_with = "duration", serialize_with = "ser_duration")]
    pub settle: Option<Duration>,
    /// Partitions a node hands over per step; default 2.
    pub max_moves: Option<usize>,
}

/// The node configuration: what a file holds, and what the merge produces.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NodeConfig {
    /// NATS server URL(s); the embedded broker when absent.
    pub nats: Option<Urls>,
    /// This node's id.
    pub node_id: Option<String>,
    /// Run id for drain markers.
    pub run_id: Option<String>,
    /// Log filter (tracing env-filter syntax).
    pub log: Option<String>,
    /// Log as JSON lines.
    pub log_json: Option<bool>,
    /// Replicas of every stream and KV bucket the job creates (1 to 5; default 1).
    pub replicas: Option<usize>,
    /// Where to serve `/metrics`, `/api/status` and the dashboard (`host:port`; none
    /// by default).
    pub http: Option<String>,
    /// The HTTP endpoint's token (`Authorization: Bearer <token>`): replays need it,
    /// and every read but the page and `/healthz` once it is set. At least 16
    /// characters; see [`http_token`](Self::http_token).
    pub http_token: Option<String>,
    /// A file holding the HTTP endpoint's token (read at start, trimmed), instead of
    /// `http_token`.
    pub http_token_file: Option<PathBuf>,
    /// Host names the HTTP endpoint answers to besides its bound address (`name` for
    /// any port, or `name:port`); requests naming any other host are refused.
    pub http_hosts: Option<Vec<String>>,
    /// Where to export spans over OTLP/HTTP (binaries built with the `otlp` feature).
    pub otlp_endpoint: Option<String>,
    /// NATS connection settings.
    #[serde(default)]
    pub connect: ConnectConfig,
    /// Cluster timing.
    #[serde(default)]
    pub cluster: ClusterSettings,
}

impl NodeConfig {
    /// Reads a config file.
    ///
    /// # Errors
    /// [`ConfigError::Read`] or [`ConfigError::Invalid`] (naming the key and line).
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Read { path: path.to_owned(), reason: e.to_string() })?;
        Self::from_toml(&text).map_err(|message| ConfigError::Invalid { path: path.to_owned(), message })
    }

    /// Parses TOML text; the error is TOML's report (line, column, key).
    ///
    /// # Errors
    /// The report as text.
    pub fn from_toml(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| e.to_string().trim_end().to_owned())
    }

    /// `self` over `lower`: every setting `self` has wins.
    pub fn over(self, lower: NodeConfig) -> NodeConfig {
        let c = self.connect;
        let l = lower.connect;
        let k = self.cluster;
        let lk = lower.cluster;
        let token_set = self.http_token.is_some() || self.http_token_file.is_some();
        NodeConfig {
            cluster: ClusterSettings {
                lease_ttl: k.lease_ttl.or(lk.lease_ttl),
                settle: k.settle.or(lk.settle),
                max_moves: k.max_moves.or(lk.max_moves),
            },
            nats: self.nats.or(lower.nats),
            node_id: self.node_id.or(lower.node_id),
            run_id: self.run_id.or(lower.run_id),
            log: self.log.or(lower.log),
            log_json: self.log_json.or(lower.log_json),
            replicas: self.replicas.or(lower.replicas),
            http: self.http.or(lower.http),
            // The token and its file are one setting: the layer that gives either wins.
            http_token: if token_set { self.http_token } else { lower.http_token },
            http_token_file: if token_set { self.http_token_file } else { lower.http_token_file },
            http_hosts: self.http_hosts.or(lower.http_hosts),
            otlp_endpoint: self.otlp_endpoint.or(lower.otlp_endpoint),
            connect: ConnectConfig {
                user: c.user.or(l.user),
                password: c.password.or(l.password),
                token: c.token.or(l.token),
                credentials: c.credentials.or(l.credentials),
                nkey_seed: c.nkey_seed.or(l.nkey_seed),
                tls_ca: c.tls_ca.or(l.tls_ca),
                tls_cert: c.tls_cert.or(l.tls_cert),
                tls_key: c.tls_key.or(l.tls_key),
                ping_interval: c.ping_interval.or(l.ping_interval),
                connect_timeout: c.connect_timeout.or(l.connect_timeout),
                request_timeout: c.request_timeout.or(l.request_timeout),
            },
        }
    }

    /// The NATS URLs, if any.
    pub fn urls(&self) -> Vec<String> {
        self.nats.as_ref().map(Urls::to_vec).unwrap_or_default()
    }

    /// The log filter (default `info`).
    pub fn log_filter(&self) -> &str {
        self.log.as_deref().unwrap_or("info")
    }

    /// Connection options for JetStream, or `None` for the embedded broker.
    ///
    /// # Errors
    /// [`ConfigError::Value`] for settings that only work together (user without
    /// password, certificate without key).
    pub fn jetstream_options(&self, client_name: &str) -> Result<Option<JetStreamOptions>, ConfigError> {
        let urls = self.urls();
        let Some(first) = urls.first() else { return Ok(None) };
        let c = &self.connect;
        let mut opts = JetStreamOptions::new(first.clone());
        opts.urls = urls;
        opts.name = Some(client_name.to_owned());
        match (&c.user, &c.password) {
            (Some(u), Some(p)) => opts.user_password = Some((u.clone(), p.clone())),
            (None, None) => {}
            _ => {
                return Err(ConfigError::Value {
                    setting: "connect.user / connect.password".into(),
                    problem: "give both, or neither".into(),
                });
            }
        }
        match (&c.tls_cert, &c.tls_key) {
            (Some(cert), Some(key)) => opts.tls_client_cert = Some((cert.clone(), key.clone())),
            (None, None) => {}
            _ => {
                return Err(ConfigError::Value {
                    setting: "connect.tls_cert / connect.tls_key".into(),
                    problem: "a client certificate needs its key: give both, or neither".into(),
                });
            }
        }
        opts.token = c.token.clone();
        opts.credentials_file = c.credentials.clone();
        opts.nkey_seed = c.nkey_seed.clone();
        opts.tls_ca = c.tls_ca.clone();
        if let Some(d) = c.ping_interval {
            opts.ping_interval = d;
        }
        if let Some(d) = c.connect_timeout {
            opts.connect_timeout = d;
        }
        if let Some(d) = c.request_timeout {
            opts.request_timeout = d;
        }
        Ok(Some(opts))
    }

    /// The cluster timing these settings give.
    ///
    /// # Errors
    /// [`ConfigError::Value`] for a lease TTL under 1s or over 10 minutes, or zero moves.
    pub fn cluster_config(&self) -> Result<flotilla_proto::cluster::control::ClusterConfig, ConfigError> {
        let mut c = flotilla_proto::cluster::control::ClusterConfig::default();
        if let Some(ttl) = self.cluster.lease_ttl {
            if !(Duration::from_secs(1)..=Duration::from_secs(600)).contains(&ttl) {
                return Err(ConfigError::Value {
                    setting: "cluster.lease_ttl (--lease-ttl)".into(),
                    problem: format!("{ttl:?} is out of range: give 1s to 10m (renewals run every third of it)"),
                });
            }
            c.lease_ttl = ttl;
            c.node_ttl = ttl;
        }
        if let Some(settle) = self.cluster.settle {
            c.settle = settle;
        }
        if let Some(moves) = self.cluster.max_moves {
            if moves == 0 {
                return Err(ConfigError::Value {
                    setting: "cluster.max_moves".into(),
                    problem: "0 would never rebalance: give 1 or more".into(),
                });
            }
            c.max_moves = moves;
        }
        Ok(c)
    }

    /// The replica count for the job's streams and buckets (default 1).
    ///
    /// # Errors
    /// [`ConfigError::Value`] outside 1 to 5.
    pub fn replicas(&self) -> Result<usize, ConfigError> {
        match self.replicas {
            None => Ok(1),
            Some(n) if (1..=flotilla_actors::MAX_REPLICAS).contains(&n) => Ok(n),
            Some(n) => Err(ConfigError::Value {
                setting: "replicas (--replicas, FLOTILLA_REPLICAS)".into(),
                problem: format!(
                    "{n} is out of range: give 1 to {} (JetStream keeps at most {} copies; use at most as many as your NATS cluster has servers)",
                    flotilla_actors::MAX_REPLICAS,
                    flotilla_actors::MAX_REPLICAS
                ),
            }),
        }
    }

    /// The HTTP endpoint's token: `http_token`, or what `http_token_file` holds, trimmed.
    ///
    /// # Errors
    /// [`ConfigError::Value`] when both are given, the file cannot be read, or the token
    /// is empty, shorter than 16 characters, or holds a space or a character a header
    /// cannot carry.
    pub fn http_token(&self) -> Result<Option<String>, ConfigError> {
        const FILE: &str = "http_token_file (--http-token-file, FLOTILLA_HTTP_TOKEN_FILE)";
        const TOKEN: &str = "http_token (--http-token, FLOTILLA_HTTP_TOKEN)";
        let (setting, what, token) = match (&self.http_token, &self.http_token_file) {
            (None, None) => return Ok(None),
            (Some(_), Some(_)) => {
                return Err(ConfigError::Value {
                    setting: format!("{TOKEN} / {FILE}"),
                    problem: "give the token or a file holding it, not both".into(),
                });
            }
            (Some(token), None) => (TOKEN, "the http token".to_owned(), token.clone()),
            (None, Some(path)) => {
                let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Value {
                    setting: FILE.into(),
                    problem: format!("cannot read the http token file {}: {e}", path.display()),
                })?;
                (FILE, format!("the http token file {}", path.display()), text)
            }
        };
        let token = token.trim();
        let problem = if token.is_empty() {
            Some(format!("{what} is empty: put a token of 16 or more characters there (e.g. `openssl rand -hex 32`)"))
        } else if token.chars().count() < 16 {
            Some(format!(
                "{what} is {} characters: use 16 or more (e.g. `openssl rand -hex 32`)",
                token.chars().count()
            ))
        } else if !token.bytes().all(|b| b.is_ascii_graphic()) {
            Some(format!("{what} holds a space or a character other than printable ASCII, which a header cannot carry"))
        } else {
            None
        };
        match problem {
            Some(problem) => Err(ConfigError::Value { setting: setting.into(), problem }),
            None => Ok(Some(token.to_owned())),
        }
    }

    /// The configuration as TOML, secrets redacted.
    pub fn to_toml_redacted(&self) -> String {
        let mut shown = self.clone();
        for secret in
            [&mut shown.connect.password, &mut shown.connect.token, &mut shown.connect.nkey_seed, &mut shown.http_token]
        {
            if secret.is_some() {
                *secret = Some("<redacted>".into());
            }
        }
        toml::to_string(&shown).unwrap_or_else(|e| format!("# cannot show the configuration: {e}\n"))
    }

    /// What a node would run with: [`to_toml_redacted`](Self::to_toml_redacted) with
    /// every setting left unset filled in with its default, and a note on what the
    /// defaults mean.
    pub fn to_toml_effective(&self) -> String {
        let mut shown = self.clone();
        let defaults = flotilla_transport::JetStreamOptions::new("");
        shown.log.get_or_insert_with(|| self.log_filter().to_owned());
        shown.log_json.get_or_insert(false);
        shown.replicas.get_or_insert(1);
        shown.connect.ping_interval.get_or_insert(defaults.ping_interval);
        shown.connect.connect_timeout.get_or_insert(defaults.connect_timeout);
        shown.connect.request_timeout.get_or_insert(defaults.request_timeout);
        if let Ok(c) = self.cluster_config() {
            shown.cluster.lease_ttl.get_or_insert(c.lease_ttl);
            shown.cluster.settle.get_or_insert(c.settle);
            shown.cluster.max_moves.get_or_insert(c.max_moves);
        }
        let mut text = String::new();
        if self.nats.is_none() {
            text.push_str("# nats: not set, so a node runs on the embedded broker (in-process, nothing survives it)\n");
        }
        if self.node_id.is_none() {
            text.push_str("# node_id: not set, so a node takes <hostname>-<pid>\n");
        }
        if self.run_id.is_none() {
            text.push_str("# run_id: not set, so a node starts a new run (or joins the current one)\n");
        }
        text.push_str(&shown.to_toml_redacted());
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_file_parses() {
        let c = NodeConfig::from_toml(
            r#"
nats = ["nats://a:4222", "nats://b:4222"]
node_id = "node-a"
log_json = true

[connect]
user = "u"
password = "p"
ping_interval = "2s"
request_timeout = "750ms"
"#,
        )
        .expect("parses");
        assert_eq!(c.urls(), vec!["nats://a:4222".to_string(), "nats://b:4222".to_string()]);
        assert_eq!(c.connect.ping_interval, Some(Duration::from_secs(2)));
        let opts = c.jetstream_options("n").expect("options").expect("nats");
        assert_eq!(opts.request_timeout, Duration::from_millis(750));
        assert_eq!(opts.user_password, Some(("u".into(), "p".into())));
        assert!(!c.to_toml_redacted().contains("\"p\""), "{}", c.to_toml_redacted());
        assert_eq!(NodeConfig::from_toml("nats = \"nats://x:1, nats://y:2\"").expect("one string").urls().len(), 2);
    }

    #[test]
    fn an_unknown_key_is_named_with_its_line() {
        let err = NodeConfig::from_toml("node_id = \"a\"\n\nlease_ttl = \"10s\"\n").expect_err("unknown key");
        assert!(err.contains("lease_ttl") && err.contains("line 3"), "{err}");
        let err = NodeConfig::from_toml("[connect]\nuser = \"u\"\npasword = \"p\"\n").expect_err("typo in a table");
        assert!(err.contains("pasword") && err.contains("line 3"), "{err}");
    }

    #[test]
    fn a_bad_duration_is_named_with_its_line() {
        let err = NodeConfig::from_toml("[connect]\n\nping_interval = \"soon\"\n").expect_err("bad duration");
        assert!(err.contains("ping_interval") && err.contains("line 3") && err.contains("5s"), "{err}");
        let err = NodeConfig::from_toml("log_json = \"yes\"\n").expect_err("wrong type");
        assert!(err.contains("log_json") && err.contains("line 1"), "{err}");
    }

    #[test]
    fn higher_layers_win_setting_by_setting() {
        let file = NodeConfig::from_toml("node_id = \"from-file\"\nlog = \"debug\"\n[connect]\ntoken = \"t\"\n")
            .expect("file");
        let env = NodeConfig { node_id: Some("from-env".into()), ..Default::default() };
        let flags = NodeConfig { log: Some("warn".into()), ..Default::default() };
        let merged = flags.over(env.over(file));
        assert_eq!(merged.node_id.as_deref(), Some("from-env"));
        assert_eq!(merged.log_filter(), "warn");
        assert_eq!(merged.connect.token.as_deref(), Some("t"), "what only the file sets survives");
    }

    #[test]
    fn settings_that_only_work_together_are_checked() {
        let c = NodeConfig::from_toml("nats = \"nats://h:4222\"\n[connect]\nuser = \"u\"\n").expect("parses");
        let err = c.jetstream_options("n").expect_err("user without password");
        assert!(err.to_string().contains("connect.user"), "{err}");
        assert!(NodeConfig::default().jetstream_options("n").expect("ok").is_none(), "embedded without URLs");
    }

    #[test]
    fn cluster_settings_parse_and_are_checked() {
        let c = NodeConfig::from_toml("[cluster]\nlease_ttl = \"3s\"\nmax_moves = 4\n").expect("parses");
        let k = c.cluster_config().expect("valid");
        assert_eq!((k.lease_ttl, k.node_ttl, k.max_moves), (Duration::from_secs(3), Duration::from_secs(3), 4));
        let c = NodeConfig::from_toml("replicas = 3\n").expect("parses");
        assert_eq!(c.replicas().expect("valid"), 3);
        assert_eq!(NodeConfig::default().replicas().expect("default"), 1);
        let c = NodeConfig::from_toml("replicas = 7\n").expect("parses");
        assert!(c.replicas().expect_err("too many").to_string().contains("1 to 5"));
        let c = NodeConfig::from_toml("replicas = 0\n").expect("parses");
        assert!(c.replicas().expect_err("none").to_string().contains("--replicas"));
        let c = NodeConfig::from_toml("[cluster]\nlease_ttl = \"100ms\"\n").expect("parses");
        assert!(c.cluster_config().expect_err("too short").to_string().contains("lease_ttl"));
        let err = NodeConfig::from_toml("[cluster]\nlease = \"3s\"\n").expect_err("unknown key");
        assert!(err.contains("lease") && err.contains("line 2"), "{err}");
    }

    #[test]
    fn the_http_token_comes_from_a_setting_or_a_file_and_is_checked() {
        let dir = tempfile::tempdir().expect("dir");
        let file = dir.path().join("token");
        std::fs::write(&file, "  0123456789abcdef0123\n").expect("write");
        let c = NodeConfig::from_toml(&format!("http_token_file = {:?}\nhttp_hosts = [\"a.example\"]\n", file))
            .expect("parses");
        assert_eq!(c.http_token().expect("read").as_deref(), Some("0123456789abcdef0123"), "trimmed");
        assert_eq!(c.http_hosts.as_deref(), Some(&["a.example".to_owned()][..]));
        // A flag's token replaces the file's token file: one setting.
        let flags = NodeConfig { http_token: Some("from-the-flag-0123".into()), ..Default::default() };
        assert_eq!(flags.over(c.clone()).http_token().expect("flag").as_deref(), Some("from-the-flag-0123"));
        let both = NodeConfig { http_token: Some("from-the-flag-0123".into()), ..c.clone() };
        assert!(both.http_token().expect_err("both").to_string().contains("not both"));
        for (text, says) in [(" \n", "is empty"), ("short", "5 characters"), ("0123456789 abcdef", "space")] {
            std::fs::write(&file, text).expect("write");
            let err = c.http_token().expect_err("refused").to_string();
            assert!(
                err.contains("http token file") && err.contains(says) && err.contains("--http-token-file"),
                "{err}"
            );
        }
        let gone = NodeConfig { http_token_file: Some(dir.path().join("missing")), ..Default::default() };
        assert!(gone.http_token().expect_err("unreadable").to_string().contains("cannot read the http token file"));
        assert_eq!(NodeConfig::default().http_token().expect("none"), None);
        let shown =
            NodeConfig { http_token: Some("from-the-flag-0123".into()), ..Default::default() }.to_toml_redacted();
        assert!(!shown.contains("from-the-flag") && shown.contains("<redacted>"), "{shown}");
    }

    #[test]
    fn a_missing_file_says_which() {
        let err = NodeConfig::from_file(Path::new("/nonexistent/flotilla.toml")).expect_err("missing");
        assert!(err.to_string().contains("/nonexistent/flotilla.toml"), "{err}");
    }
}
