//! The reader task: the SUB socket (subscribed before it connects, through the loopback ZMTP
//! guard), reconnects with exponential back-off, and the bounded queue to the processor, each
//! message tagged with its connection epoch.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use ic_shared::kv::decode::decoded_bytes_bound;
use ic_shared::timing::{self, Stage};
use tokio::sync::mpsc;
use zeromq::{Socket, SocketEvent, SocketOptions, SocketRecv, SubSocket, ZmqMessage};

use std::sync::atomic::AtomicUsize;

use super::super::zmtp_guard::{self, Dropped, GuardListener, Guarded, OnDrop, ZmtpLimits};
use super::budget::{self, InflightPermit};
use super::{
    bound_endpoint, now_unix_ms, record_drop, set_connected, Sink, StreamShared, SubscriberOptions,
};

/// The limits of one stream's sockets (see [`zmtp_guard`]).
pub(super) fn limits(opts: &SubscriberOptions) -> ZmtpLimits {
    ZmtpLimits {
        max_message_bytes: opts.max_message_bytes,
        ..ZmtpLimits::default()
    }
    .clamped()
}

/// Counts and logs an engine peer dropped by the guard: `socket` is `events` (the publisher)
/// or `replay`.
pub(super) fn record_peer_drop(
    shared: &StreamShared,
    sink: &Sink,
    socket: &'static str,
    d: Dropped,
) {
    let id = shared.id();
    sink.metrics
        .peers_dropped
        .with_label_values(&[id, socket, d.violation.reason()])
        .inc();
    let endpoint = match socket {
        "replay" => shared.spec.replay_endpoint.as_deref().unwrap_or(""),
        _ => shared.spec.endpoint.as_str(),
    };
    tracing::warn!(
        stream = %id,
        socket,
        endpoint,
        reason = d.violation.reason(),
        announced = d.announced,
        limit = d.limit,
        "kv events: engine connection dropped: {d}"
    );
    shared.lock().stats.last_error = Some(format!(
        "{socket} socket {endpoint}: connection dropped: {d}"
    ));
}

/// Connects a SUB socket (subscribed first) through the guard ([`zmtp_guard`]) with capped
/// exponential backoff; for an `@…` endpoint ([`bound_endpoint`]) binds the guard's listener
/// there instead and returns once a publisher has connected. The returned [`Guarded`] relay
/// must live as long as the socket. `backoff` is the wait after the next failure; the caller
/// resets it once a connection delivered a message, so a publisher that is dropped before its
/// first message (a hostile one) is retried at most every [`SubscriberOptions::reconnect_max`].
pub(super) async fn connect_sub(
    shared: &Arc<StreamShared>,
    sink: &Sink,
    opts: &SubscriberOptions,
    backoff: &mut Duration,
) -> (
    SubSocket,
    futures::channel::mpsc::Receiver<SocketEvent>,
    Guarded,
    zmtp_guard::Charges,
) {
    let id = shared.id();
    let on_drop: OnDrop = {
        let (shared, sink) = (shared.clone(), sink.clone());
        Arc::new(move |d| record_peer_drop(&shared, &sink, "events", d))
    };
    loop {
        let charges = zmtp_guard::Charges::default();
        let relay_budget = Some(zmtp_guard::RelayBudget {
            budget: sink.budget.clone(),
            charges: charges.clone(),
            wait: RELAY_BUDGET_WAIT,
        });
        let guarded = if let Some(ep) = bound_endpoint(&shared.spec.endpoint) {
            match GuardListener::bind(&super::super::publish::bind_endpoint(ep)).await {
                Ok(l) => {
                    l.accept(
                        limits(opts),
                        opts.connect_timeout,
                        on_drop.clone(),
                        relay_budget,
                    )
                    .await
                }
                Err(e) => Err(e),
            }
        } else {
            zmtp_guard::connect_budgeted(
                &shared.spec.endpoint,
                limits(opts),
                opts.connect_timeout,
                on_drop.clone(),
                relay_budget,
            )
            .await
        };
        let error = match guarded {
            Err(e) => e,
            Ok(guarded) => {
                let mut zopts = SocketOptions::default();
                zopts.connect_timeout(opts.connect_timeout);
                let mut sock = SubSocket::with_options(zopts);
                let monitor = sock.monitor();
                if let Err(e) = sock.subscribe(&shared.spec.topic).await {
                    shared.lock().stats.last_error = Some(format!("subscribe: {e}"));
                }
                let attempt = tokio::time::timeout(
                    opts.connect_timeout + Duration::from_secs(1),
                    sock.connect(guarded.endpoint()),
                )
                .await;
                match attempt {
                    Ok(Ok(())) => return (sock, monitor, guarded, charges),
                    Ok(Err(e)) => format!("connect {}: {e}", shared.spec.endpoint),
                    Err(_) => format!("connect {}: timed out", shared.spec.endpoint),
                }
            }
        };
        tracing::debug!(stream = %id, "kv events: {error}");
        shared.lock().stats.last_error = Some(error);
        tokio::time::sleep(*backoff).await;
        *backoff = next_backoff(*backoff, opts);
    }
}

/// Longest a large frame waits for the node's in-flight budget in the relay before its engine
/// is dropped (`peers_dropped_total{reason="inflight_budget"}`): 10 s.
const RELAY_BUDGET_WAIT: Duration = Duration::from_secs(10);

pub(super) fn next_backoff(backoff: Duration, opts: &SubscriberOptions) -> Duration {
    (backoff * 2).min(opts.reconnect_max.max(opts.reconnect_initial))
}

/// One queued message: its connection epoch, the message, and its charge against the
/// node-wide budget (returned once the processor is done with it).
pub(super) type Queued = (u64, ZmqMessage, InflightPermit);

/// The reader's end of the queue: messages and the payload bytes they hold.
pub(super) struct Queue {
    pub(super) tx: mpsc::Sender<Queued>,
    pub(super) bytes: Arc<AtomicUsize>,
}

/// Bytes of a message's frames.
pub(super) fn message_bytes(m: &ZmqMessage) -> usize {
    m.iter().map(|f| f.len()).sum()
}

pub(super) async fn read_loop(
    shared: Arc<StreamShared>,
    sink: Sink,
    opts: SubscriberOptions,
    queue: Queue,
) {
    let id = shared.id().to_string();
    set_connected(&shared, &sink, false);
    let mut backoff = opts.reconnect_initial;
    loop {
        // `_relay` carries the engine's bytes to `sock`; dropping it closes the connection.
        let (mut sock, mut monitor, _relay, charges) =
            connect_sub(&shared, &sink, &opts, &mut backoff).await;
        let received_before = shared.lock().stats.batches_received;
        let epoch = shared.epoch.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::info!(stream = %id, endpoint = %shared.spec.endpoint, epoch, "kv events: connected");
        // The connect errors before this connection are history: /v1/report's lastError shows
        // what is wrong now.
        shared.lock().stats.last_error = None;
        shared.disconnected_at_ms.store(0, Ordering::Relaxed);
        set_connected(&shared, &sink, true);
        shared.link_changed.notify_one();
        let mut monitor_open = true;
        let forward = |m: ZmqMessage| -> bool {
            if let Some(seq) = m.get(1).and_then(|f| <[u8; 8]>::try_from(f.as_ref()).ok()) {
                timing::mark(Stage::KvReceived, u64::from_be_bytes(seq));
            }
            sink.metrics
                .received
                .with_label_values(&[&id, "live"])
                .inc();
            {
                let mut g = shared.lock();
                g.stats.batches_received += 1;
                g.stats.last_message_unix_ms = Some(now_unix_ms());
            }
            let size = message_bytes(&m);
            // What the relay charged for this message's large frames (the library's buffer);
            // dropped with the message.
            let relayed = charges
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop_front()
                .flatten();
            if queue.bytes.load(Ordering::Relaxed).saturating_add(size) > opts.queue_max_bytes {
                record_drop(&shared, &sink, "queue_full", 1);
                return true;
            }
            // What decoding it may allocate, charged before anything is decoded, and its bytes
            // unless the relay charged them already.
            let wire = if relayed.is_some() { 0 } else { size };
            let cost = wire.saturating_add(
                m.get(2)
                    .map_or(0, |payload| decoded_bytes_bound(payload.as_ref())),
            );
            let Some(mut permit) = sink.budget.try_charge(cost) else {
                record_drop(&shared, &sink, budget::DROP_REASON, 1);
                // Whatever it held is missing from the replica from now on: Stale
                // TailUnverified (not routed) until the processor sees the gap it left healed,
                // or a tail check finds nothing lost.
                shared.lock().state.set_tail_unverified(true);
                tracing::debug!(stream = %id, bytes = size, charge = cost, in_flight = sink.budget.used(), limit = sink.budget.limit(), "kv events: message dropped: the node's in-flight budget is spent");
                return true;
            };
            if let Some(r) = relayed {
                permit.absorb(r);
            }
            queue.bytes.fetch_add(size, Ordering::Relaxed);
            match queue.tx.try_send((epoch, m, permit)) {
                Ok(()) => true,
                Err(mpsc::error::TrySendError::Full(_)) => {
                    queue.bytes.fetch_sub(size, Ordering::Relaxed);
                    record_drop(&shared, &sink, "queue_full", 1);
                    true
                }
                Err(mpsc::error::TrySendError::Closed(_)) => false,
            }
        };
        loop {
            tokio::select! {
                msg = sock.recv() => match msg {
                    Ok(m) => {
                        if !forward(m) {
                            return;
                        }
                    }
                    Err(e) => {
                        shared.lock().stats.last_error = Some(format!("recv: {e}"));
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
                ev = monitor.next(), if monitor_open => match ev {
                    Some(SocketEvent::Disconnected(_)) => break,
                    Some(_) => {}
                    None => monitor_open = false,
                },
            }
        }
        // Take what the socket still holds, then connect afresh: our backoff, not the
        // library's (which grows to 30 s).
        while let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(5), sock.recv()).await {
            if !forward(m) {
                return;
            }
        }
        drop(sock);
        // Charges of messages the library never delivered go back to the budget now, not at
        // the next connection.
        drop(charges);
        shared
            .disconnected_at_ms
            .store(now_unix_ms().max(1), Ordering::Relaxed);
        set_connected(&shared, &sink, false);
        shared.link_changed.notify_one();
        tracing::info!(stream = %id, endpoint = %shared.spec.endpoint, "kv events: publisher gone; reconnecting");
        if shared.lock().stats.batches_received > received_before {
            backoff = opts.reconnect_initial;
        } else {
            // Nothing came on that connection (an engine dropped by the guard at its first
            // header, or one that keeps going away): wait before the next one, longer each time.
            tokio::time::sleep(backoff).await;
            backoff = next_backoff(backoff, &opts);
        }
    }
}

/// A message's engine seq and payload (the received frame itself, not a copy), or the drop
/// reason.
pub(super) fn split_live(msg: ZmqMessage) -> Result<(u64, prost::bytes::Bytes), &'static str> {
    let mut frames = msg.into_vec();
    if frames.len() != 3 {
        return Err("bad_frames");
    }
    let seq: [u8; 8] = frames[1].as_ref().try_into().map_err(|_| "bad_seq")?;
    let payload = frames.pop().ok_or("bad_frames")?;
    Ok((u64::from_be_bytes(seq), payload))
}
