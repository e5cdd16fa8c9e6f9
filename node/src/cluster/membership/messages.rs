//! The membership actor's own message: control requests arrive as
//! [`ControlMessage`]s. [`Leave`](super::Leave) and [`Deregister`](super::Deregister)
//! are `flotilla-actors`' (a running job sends them).

use actix::prelude::*;
use flotilla_transport::broker::CoreMessage;

/// A control request arrived on `flotilla.<J>._ctl.…`.
#[derive(Debug, Clone, Message)]
#[rtype(result = "()")]
pub struct ControlMessage(pub CoreMessage);
