//! The closed sets of label values that [`super::ControllerMetrics`] creates at 0 and the code
//! that counts names: which hold of the index write lock (`index_write_hold_seconds{what}`,
//! taken in `crate::state`) and why a prompt text got no lookup
//! (`prompt_text_refusals_total{reason}`, decided in `crate::tokenize`). Their own module below
//! the metrics, the shared state and the tokenizers, so none of those imports another for them
//! (issue 42).

/// What one hold of the index write lock applies: the `what` label of
/// `inferencecache_controller_index_write_hold_seconds` (docs/operations.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteHold {
    /// One agent `KvDeltaBatch`.
    Deltas,
    /// The start of an agent resync (its streams registered, the node's old ones dropped).
    ResyncBegin,
    /// One slice of an agent resync's entries.
    ResyncSlice,
    /// One agent `EngineCounters` report.
    Counters,
    /// An agent's stream opened: what an older stream of its node reported marked unreported.
    Connect,
    /// An agent's stream ended: its node marked unreported.
    Disconnect,
    /// Nodes past `--node-expiry` dropped.
    Expire,
    /// The CacheTenant quotas replaced (`reconcile::tenants`).
    TenantQuotas,
    /// The routing gate's synthetic probe stream added or removed (`probe`).
    Probe,
}

impl WriteHold {
    /// Every value, in label order.
    pub const ALL: [WriteHold; 9] = [
        WriteHold::Deltas,
        WriteHold::ResyncBegin,
        WriteHold::ResyncSlice,
        WriteHold::Counters,
        WriteHold::Connect,
        WriteHold::Disconnect,
        WriteHold::Expire,
        WriteHold::TenantQuotas,
        WriteHold::Probe,
    ];

    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            WriteHold::Deltas => "deltas",
            WriteHold::ResyncBegin => "resync_begin",
            WriteHold::ResyncSlice => "resync_slice",
            WriteHold::Counters => "counters",
            WriteHold::Connect => "connect",
            WriteHold::Disconnect => "disconnect",
            WriteHold::Expire => "expire",
            WriteHold::TenantQuotas => "tenant_quotas",
            WriteHold::Probe => "probe",
        }
    }
}

/// Why a request's prompt text got no lookup: the NO_HINT reason of the answer
/// (`LookupRouteResponse.reason`), never a gRPC error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptRefusal {
    /// The text is longer than [`MAX_PROMPT_TEXT_BYTES`](ic_shared::limits::MAX_PROMPT_TEXT_BYTES) bytes, or tokenizes to more than
    /// [`MAX_LOOKUP_TOKENS`](ic_shared::limits::MAX_LOOKUP_TOKENS) ids.
    TooLarge,
    /// The request names no model, so no tokenizer can be chosen.
    NoModel,
    /// No `--tokenizer` names the request's model.
    NoTokenizer,
    /// The model's tokenizer file has never loaded (the log and
    /// `tokenizer_load_failing{model}` say why).
    TokenizerUnavailable,
    /// The tokenizer refused the text (logged).
    TokenizationFailed,
}

impl PromptRefusal {
    /// Every refusal, for metric initialisation.
    pub const ALL: [PromptRefusal; 5] = [
        PromptRefusal::TooLarge,
        PromptRefusal::NoModel,
        PromptRefusal::NoTokenizer,
        PromptRefusal::TokenizerUnavailable,
        PromptRefusal::TokenizationFailed,
    ];

    /// The CamelCase NO_HINT reason.
    pub fn reason(self) -> &'static str {
        match self {
            PromptRefusal::TooLarge => "PromptTextTooLarge",
            PromptRefusal::NoModel => "PromptTextWithoutModel",
            PromptRefusal::NoTokenizer => "NoTokenizerForModel",
            PromptRefusal::TokenizerUnavailable => "TokenizerUnavailable",
            PromptRefusal::TokenizationFailed => "TokenizationFailed",
        }
    }

    /// The `reason` label of `inferencecache_controller_prompt_text_refusals_total`.
    pub fn label(self) -> &'static str {
        match self {
            PromptRefusal::TooLarge => "too_large",
            PromptRefusal::NoModel => "no_model",
            PromptRefusal::NoTokenizer => "no_tokenizer",
            PromptRefusal::TokenizerUnavailable => "tokenizer_unavailable",
            PromptRefusal::TokenizationFailed => "tokenization_failed",
        }
    }
}

/// Why an `AgentService.Connect` stream was refused: the `reason` label of
/// `inferencecache_controller_agent_streams_total{outcome="rejected"}` (docs/operations.md).
/// Authentication failures are told apart further in `agent_auth_total{result}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamRejection {
    /// `--agent-max-pending-hellos` streams were already awaiting their Hello.
    PendingHellosFull,
    /// The source address already held its share of the pending-Hello slots
    /// (`--agent-max-pending-hellos-per-source`).
    PendingPerSourceFull,
    /// No first message within `--agent-hello-timeout-seconds`.
    HelloTimeout,
    /// The first message announced, or the stream sent, more than `--agent-pre-auth-bytes`
    /// before its Hello was accepted.
    FirstMessageTooLarge,
    /// The stream failed (reset, undecodable message) before its first message.
    StreamError,
    /// The first message was not a Hello (or the stream ended before one).
    NoHello,
    /// A Hello with an empty node, names over the length cap, too many capabilities, or an
    /// incomplete `pod_subscriber`.
    InvalidHello,
    /// The token was missing or did not verify.
    Unauthenticated,
    /// A valid token of another identity (service account, node, namespace or pod).
    WrongIdentity,
    /// The token could not be verified right now (TokenReview failed).
    ReviewUnavailable,
    /// The source address used up its share of TokenReviews.
    ReviewRateLimited,
    /// A subscriber of a pod the node plans do not know (or before plans are derived).
    NotPlanned,
}

impl StreamRejection {
    /// Every value, in label order.
    pub const ALL: [StreamRejection; 12] = [
        StreamRejection::PendingHellosFull,
        StreamRejection::PendingPerSourceFull,
        StreamRejection::HelloTimeout,
        StreamRejection::FirstMessageTooLarge,
        StreamRejection::StreamError,
        StreamRejection::NoHello,
        StreamRejection::InvalidHello,
        StreamRejection::Unauthenticated,
        StreamRejection::WrongIdentity,
        StreamRejection::ReviewUnavailable,
        StreamRejection::ReviewRateLimited,
        StreamRejection::NotPlanned,
    ];

    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            StreamRejection::PendingHellosFull => "pending_hellos_full",
            StreamRejection::PendingPerSourceFull => "pending_per_source_full",
            StreamRejection::HelloTimeout => "hello_timeout",
            StreamRejection::FirstMessageTooLarge => "first_message_too_large",
            StreamRejection::StreamError => "stream_error",
            StreamRejection::NoHello => "no_hello",
            StreamRejection::InvalidHello => "invalid_hello",
            StreamRejection::Unauthenticated => "unauthenticated",
            StreamRejection::WrongIdentity => "wrong_identity",
            StreamRejection::ReviewUnavailable => "review_unavailable",
            StreamRejection::ReviewRateLimited => "review_rate_limited",
            StreamRejection::NotPlanned => "not_planned",
        }
    }

    /// The rejection of a failed first message ([`tonic::Status`] of
    /// `ingest::handshake::first_message`): `DEADLINE_EXCEEDED` is the Hello deadline,
    /// `RESOURCE_EXHAUSTED` the pre-authentication byte cap, anything else a stream error.
    pub fn of_first_message(status: &tonic::Status) -> Self {
        match status.code() {
            tonic::Code::DeadlineExceeded => StreamRejection::HelloTimeout,
            tonic::Code::ResourceExhausted => StreamRejection::FirstMessageTooLarge,
            _ => StreamRejection::StreamError,
        }
    }
}
