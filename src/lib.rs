#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub use flotilla_actors as actors;
pub use flotilla_node as node;
pub use flotilla_transport as transport;

pub use flotilla_node::NodeError;

/// What a job or tool usually needs in scope.
pub mod prelude {
    pub use flotilla_actors::{
        FailurePolicy, Job, MessageMeta, Misfire, Producer, ProducerError, RetryPolicy, Sent, ShutdownScope, Store,
        StoreDef, StreamDef, Task, TaskConfig, TaskContext, TaskError,
    };
    pub use flotilla_node::connect::{BrokerChoice, connect};
    pub use flotilla_node::{JobRunner, NodeArgs, NodeError};
    pub use flotilla_transport::broker::{
        AckKind, Broker, BrokerError, ConsumerSpec, Delivery, OutboundMessage, SharedBroker, StreamSpec,
    };
    pub use flotilla_transport::wire::{Codec, CodecError, Headers, JobName, MessageId, StreamName, Subjects};
    pub use serde::{Deserialize, Serialize};
}
