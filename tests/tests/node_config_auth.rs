//! Connection settings from a config file reach the server: user and password
//! against a nats-server that requires them.

use flotilla_node::NodeArgs;
use flotilla_tests::NatsServer;

#[tokio::test]
async fn user_and_password_from_the_config_file_authenticate() {
    let server = NatsServer::start_with(&["--user", "flotilla", "--pass", "s3cret"]);
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("node.toml");
    std::fs::write(
        &file,
        format!("nats = \"{}\"\n[connect]\nuser = \"flotilla\"\npassword = \"s3cret\"\n", server.url()),
    )
    .expect("write");
    let args = NodeArgs { config: Some(file.clone()), ..NodeArgs::default() };
    let broker = args.connect("auth-test").await.expect("authenticated");
    assert_eq!(broker.server().kind, flotilla_transport::broker::BrokerKind::JetStream);

    let wrong = NodeArgs { config: Some(file), nats_password: Some("wrong".into()), ..NodeArgs::default() };
    let err = wrong.connect("auth-test").await.expect_err("a flag overrides the file's password, and it is wrong");
    let text = err.to_string().to_lowercase();
    assert!(text.contains("authorization") || text.contains("auth"), "{text}");
}
