//! `flotilla config` shows the effective configuration: flags over FLOTILLA_* variables
//! over the file; a bad file names the key and its line.

use std::process::Command;

fn flotilla() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_flotilla"));
    cmd.env_clear();
    cmd
}

#[test]
fn flags_beat_environment_beat_the_file() {
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("node.toml");
    std::fs::write(
        &file,
        "nats = \"nats://from-file:4222\"\nnode_id = \"from-file\"\nlog = \"debug\"\n\n[connect]\ntoken = \"s3cret\"\nping_interval = \"2s\"\n",
    )
    .expect("write");
    let out = flotilla()
        .args(["--config"])
        .arg(&file)
        .args(["--log", "warn", "config"])
        .env("FLOTILLA_NODE_ID", "from-env")
        .env("FLOTILLA_LOG", "error")
        .output()
        .expect("run flotilla");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("nats = \"nats://from-file:4222\""), "file only: {text}");
    assert!(text.contains("node_id = \"from-env\""), "environment over file: {text}");
    assert!(text.contains("log = \"warn\""), "flag over environment: {text}");
    assert!(text.contains("ping_interval = \"2s\""), "{text}");
    assert!(!text.contains("s3cret") && text.contains("<redacted>"), "secrets are not shown: {text}");
}

#[test]
fn the_config_file_can_come_from_the_environment() {
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("node.toml");
    std::fs::write(&file, "node_id = \"n1\"\n").expect("write");
    let out = flotilla().arg("config").env("FLOTILLA_CONFIG", &file).output().expect("run");
    assert!(String::from_utf8_lossy(&out.stdout).contains("node_id = \"n1\""));
}

#[test]
fn a_bad_file_names_the_key_and_the_line() {
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("node.toml");
    std::fs::write(&file, "node_id = \"a\"\n[connect]\nping_interval = \"later\"\n").expect("write");
    let out = flotilla().arg("--config").arg(&file).arg("config").output().expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("line 3") && err.contains("ping_interval") && err.contains("node.toml"), "{err}");
    std::fs::write(&file, "nodeid = \"a\"\n").expect("write");
    let out = flotilla().arg("--config").arg(&file).arg("info").output().expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("unknown field `nodeid`") && err.contains("line 1"), "{err}");
}
